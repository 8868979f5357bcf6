from reshard.cli import run

if __name__ == "__main__":  # spawned worker processes import this module as __mp_main__
    run()
