from reshard.cli import main

main()
