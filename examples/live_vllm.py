"""Push a trainer's weights into a running vLLM engine with ``reshard.live``: two trainer processes holding
Megatron tp 2 shards, one vLLM engine at TP 1 whose model parameters are filled in place.

    python examples/live_vllm.py CKPT                          # spawns the three processes itself
    torchrun --nproc-per-node 3 examples/live_vllm.py CKPT     # the same, launched by torchrun

Run it with the python of an environment holding vLLM and reshard (the trainers need only reshard and torch; under
torchrun every rank runs one interpreter). CKPT is any checkpoint reshard reads with a Hugging Face
``config.json`` (an HF folder, reshard's Megatron output, ...). Ranks 0 and 1 are the trainers: each holds its
Megatron tp 2 shard (``reshard.load_rank(CKPT, to="megatron", tp=2, rank=r)``, standing in for the model a real
trainer has in memory). Rank 2 is the engine: ``vllm.LLM(CKPT, load_format="dummy")`` (random weights, so the
update is visible), prompt logprobs, then ``live.transfer(plan, into=<the model's own tensors>)``, then the
logprobs again, now the checkpoint's. ``--out DIR`` writes each rank's result as ``DIR/rank-N.json``.

What it takes to reach vLLM 0.32's model and to give it a process group of its own:

* The engine must run the model in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set here before vLLM is
  imported) makes the V1 engine core, and at TP 1 its only worker, run in-process, and ``LLM.apply_model(fn)``
  calls ``fn(model)`` in that worker. (With multiprocessing, ``fn`` would be pickled into the engine-core
  process, and the process group below would have to be made there.)
* vLLM's CPU build repacks every linear weight for oneDNN after loading and drops the parameter
  (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``): a forward then never reads ``layer.weight``, so
  an in-place update would change nothing. :func:`keep_cpu_weights` keeps the parameters (same kernels, same
  numbers) and :func:`repack_cpu_weights` packs them again after each update, as vLLM's own reload does
  (``process_weights_after_loading``). vLLM on GPU uses its parameters as they are: neither is needed there.
* ``into=``: the model's ``state_dict(keep_vars=True)`` (its Parameters themselves, and the persistent buffers:
  the attention ``_k_scale`` / ``_v_scale`` / ``_q_scale`` / ``_prob_scale`` scalars vLLM registers as buffers,
  which reshard's vLLM layout holds too and fills with their constant 1.0), restricted to the names the plan's
  target rank holds: a tied ``model.embed_tokens.weight`` shares ``lm_head.weight``'s storage and is filled
  through it. Every name the target needs is in it, so nothing is allocated (``stats.allocated == []``).
* The process group: vLLM's worker owns the engine process's default group (a world of 1) and the trainers own
  theirs (a world of 2, as a real trainer's). :func:`live_group` makes a third, gloo, group over all three
  processes from one ``TCPStore`` (torchrun's agent store, or the one the spawning parent hosts) without touching
  either default group: ``torch.distributed.distributed_c10d._new_process_group_helper`` (what
  ``init_process_group`` itself calls) creates and registers it. ``reshard.live`` addresses peers as
  ``dist.get_rank(group)`` and ``dist.get_global_rank(group, r)``, which torch computes from this process's
  rank in its *default* group, so the group's rank table maps that default rank to the live rank (and the other
  live ranks to placeholder "global" ranks that only this process's table uses).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

TRAINERS = 2  # Megatron tp 2: live ranks 0 and 1
ENGINE = TRAINERS  # the vLLM engine: live rank 2
WORLD = TRAINERS + 1
DTYPE_KEY = "reshard-live-example/dtype"  # the engine's dtype, for the trainers: the wire carries it
PROMPTS = [[1, 17, 99, 3, 512, 640, 7, 998, 250, 64, 963, 2], [5, 900, 42, 42, 8, 700, 333]]
# what torchrun sets; the engine drops them before vLLM starts its own world of 1 (with TORCHELASTIC_USE_AGENT_STORE
# set, torch would look for vLLM's rendezvous store in torchrun's agent instead of hosting it)
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def connect_store(timeout: datetime.timedelta):
    """The launcher's store at MASTER_ADDR:MASTER_PORT (torchrun's agent store, or the spawning parent's); this
    rank's live rank."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else live rank 0 hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), WORLD,
                          is_master=rank == 0 and not hosted, timeout=timeout, wait_for_workers=False)
    return store, rank


def live_group(store, rank: int, size: int, timeout: datetime.timedelta, name: str = "reshard-live"):
    """A gloo group of ``size`` processes over ``store`` in which this process is ``rank``, registered with
    torch.distributed beside this process's default group, which stays as it is (see the module docstring)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    pg, _ = c10d._new_process_group_helper(size, rank, [], "gloo", dist.PrefixStore(f"{name}/", store),
                                           group_name=name, timeout=timeout)
    me = dist.get_rank()  # this process's rank in its default group
    members = list(range(size))  # members[live rank] = the "global" rank this process's table gives it
    if me in members:
        members[members.index(me)], members[rank] = members[rank], me
    else:
        members[rank] = me
    c10d._world.pg_group_ranks[pg] = {g: r for r, g in enumerate(members)}
    assert dist.get_rank(pg) == rank
    return pg


def make_plan(ckpt: str):
    from reshard import live

    return live.plan(ckpt, source={"layout": "megatron", "tp": TRAINERS}, target={"layout": "vllm", "tp": 1},
                     source_ranks=list(range(TRAINERS)), target_ranks=[ENGINE])


def trainer(args, store, rank: int, timeout) -> dict:
    import torch.distributed as dist

    import reshard
    from reshard import live

    dist.init_process_group("gloo", store=dist.PrefixStore("trainer/", store), rank=rank, world_size=TRAINERS,
                            timeout=timeout)  # the trainer's own world (its Megatron groups would live here)
    weights = reshard.load_rank(args.ckpt, to="megatron", tp=TRAINERS, rank=rank)  # the model's state_dict()
    group = live_group(store, rank, WORLD, timeout)
    dtype = store.get(DTYPE_KEY).decode()  # every participant passes the same dtype: the engine's
    got = live.transfer(make_plan(args.ckpt), weights, group=group, dtype=dtype)
    print(f"trainer {rank}: {got.stats}", flush=True)
    dist.destroy_process_group(group)
    dist.destroy_process_group()
    return {"role": "trainer", "stats": got.stats.as_dict()}


_dispatch = None


def keep_cpu_weights() -> None:
    """Make vLLM's CPU build keep each linear layer's weight after packing it (call before building the LLM)."""
    global _dispatch
    from vllm.model_executor.layers import utils

    if _dispatch is None:
        _dispatch = utils.dispatch_cpu_unquantized_gemm
        utils.dispatch_cpu_unquantized_gemm = lambda layer, remove_weight: _dispatch(layer, remove_weight=False)


def repack_cpu_weights(model) -> int:
    """Pack the (updated) weights of every layer vLLM's CPU build packed at load time; how many."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    layers = [m for m in model.modules() if hasattr(m, "cpu_linear") and getattr(m, "weight", None) is not None
              and m.weight.dim() == 2 and m.weight.numel()]
    for layer in layers:
        _dispatch(layer, remove_weight=False)
    return len(layers)


def update(model, ckpt: str, group, dtype) -> dict:
    """Runs inside vLLM's worker (``LLM.apply_model``): receive this rank's tensors into the model in place."""
    import torch

    from reshard import live

    plan = make_plan(ckpt)
    state = model.state_dict(keep_vars=True)
    names = [t.name for t in plan.targets[plan.target_ranks.index(ENGINE)]]
    missing = [n for n in names if n not in state]
    if missing:
        raise ValueError(f"vLLM's model has no tensor '{missing[0]}' that reshard's vLLM layout holds")
    into = {n: state[n] for n in names}
    ptrs = {n: t.data_ptr() for n, t in into.items()}
    with torch.no_grad():
        got = live.transfer(plan, None, group=group, dtype=dtype, into=into)
    repacked = repack_cpu_weights(model)
    print(f"engine: {got.stats}; {len(into)} tensors filled in place, {repacked} layers repacked", flush=True)
    return {"stats": got.stats.as_dict(), "tensors": len(into), "repacked": repacked,
            "in_place": all(got[n] is into[n] and into[n].data_ptr() == ptrs[n] for n in into)}


def prompt_logprobs(llm, prompts: list[list[int]], top_k: int) -> list:
    """Per prompt, per position from 1 on: ``{token id: logprob}`` (the actual next token and vLLM's top K)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(prompt_logprobs=top_k, max_tokens=1, temperature=0.0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
    return [[{str(t): lp.logprob for t, lp in entry.items()} for entry in out.prompt_logprobs[1:]] for out in outputs]


def engine(args, store, timeout) -> dict:
    for var in LAUNCHER_VARS + ("TORCHELASTIC_USE_AGENT_STORE",):
        os.environ.pop(var, None)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    keep_cpu_weights()
    llm = LLM(model=args.ckpt, load_format="dummy", tensor_parallel_size=1, dtype=args.dtype or "auto",
              skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, max_num_seqs=4, seed=0)
    before = prompt_logprobs(llm, args.prompts, args.top_k)
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")  # what "auto" chose, e.g. bfloat16
    store.set(DTYPE_KEY, dtype)
    group = live_group(store, ENGINE, WORLD, timeout)
    result = llm.apply_model(lambda model: update(model, args.ckpt, group, dtype))[0]
    llm.reset_prefix_cache()  # KV blocks cached from the old weights
    after = prompt_logprobs(llm, args.prompts, args.top_k)
    for ids, old, new in zip(args.prompts, before, after):
        actual = [ids[i + 1] for i in range(len(ids) - 1)]
        print(f"engine: prompt {ids[:4]}...: mean logprob of the actual tokens "
              f"{sum(o[str(t)] for o, t in zip(old, actual)) / len(actual):.3f} before, "
              f"{sum(n[str(t)] for n, t in zip(new, actual)) / len(actual):.3f} after the update", flush=True)
    import torch.distributed as dist

    dist.destroy_process_group(group)
    return dict(result, role="engine", before=before, after=after)


def spawn(argv: list[str]) -> int:
    """Run the three ranks as this script's children, the way torchrun would (this process hosts the store)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)  # a free port
    port = store.port
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env))
    codes = [None] * WORLD
    try:
        while None in codes:
            for i, p in enumerate(procs):
                if codes[i] is None:
                    try:
                        codes[i] = p.wait(timeout=0.5)
                    except subprocess.TimeoutExpired:
                        continue
                    if codes[i] != 0:  # as torchrun does: one rank failed, stop the others
                        print(f"rank {i} exited with {codes[i]}: stopping the others", file=sys.stderr, flush=True)
                        for other in procs:
                            if other.poll() is None:
                                other.kill()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return max((abs(c) for c in codes if c), default=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", help="a checkpoint folder reshard reads, with a Hugging Face config.json")
    parser.add_argument("--dtype", default=None,
                        help="the engine's dtype (default: vLLM's choice); the trainers cast to it on the way")
    parser.add_argument("--prompts", type=json.loads, default=PROMPTS, help="JSON list of token-id lists")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the rendezvous and the transfer")
    parser.add_argument("--out", help="a folder: each rank writes its result to rank-N.json")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        return spawn(sys.argv[1:])
    timeout = datetime.timedelta(seconds=args.timeout)
    store, rank = connect_store(timeout)
    result = engine(args, store, timeout) if rank == ENGINE else trainer(args, store, rank, timeout)
    if args.out:
        with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
