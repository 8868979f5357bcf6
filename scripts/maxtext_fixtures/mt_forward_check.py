"""MaxText itself on a checkpoint reshard wrote (maxtext-orbax.md section 7.7, acceptance 3); run by
tests/test_maxtext_oracle.py under the MaxText venv (Python 3.12, maxtext 0.2.5), one process per step, never
imported by pytest. No torch here.

usage: python mt_forward_check.py forward JSON   # {"items", "model_name", "overrides", "scan", "scratch", "save"}
       python mt_forward_check.py train JSON     # {"items", "model_name", "overrides", "scan", "out", "steps",
                                                 #  "seq", "tokens"}

- forward: MaxText's ``model_creation_utils.from_pretrained`` + forward, fp32 weights and activations,
  ``matmul_precision=highest``, on ``load_parameters_path=<items>`` (make_fixtures.py's ``mt_forward``, the same
  8 token ids as the fixtures' ``logits.safetensors``); saves the logits ``[8, V_maxtext]`` as .npy at ``save``.
- train: MaxText's trainer (``maxtext.trainers.pre_train.train``, as ``python -m`` runs it) for ``steps`` steps
  from ``load_parameters_path=<items>``, fp32, synthetic data without packing (one sequence of ``seq`` tokens);
  saves that synthetic batch's ``[1, seq + 1]`` token ids as MaxText's ``SyntheticDataIterator`` drew them (its
  ``__init__`` wrapped to copy them out) at ``tokens`` as .npy, so the caller can compute the step-0 loss with
  another implementation. The per-step losses are in the trainer's log ("completed step: N, ... loss: X").
"""
import json
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (stdlib-only at import: the MaxText side's helpers)


def train(a: dict) -> None:
    mf._mt_env(1)
    import numpy as np
    from maxtext.input_pipeline import synthetic_data_processing as sdp
    init = sdp.SyntheticDataIterator.__init__

    def keep_tokens(self, config, mesh):  # the trainer's own synthetic batch, saved as drawn (no change to it)
        init(self, config, mesh)
        np.save(a["tokens"], np.asarray(self.data[0]))

    sdp.SyntheticDataIterator.__init__ = keep_tokens
    sys.argv = ["train", mf._base_yml(), f"model_name={a['model_name']}", *a["overrides"],
                f"load_parameters_path={a['items']}", f"scan_layers={a['scan']}",
                f"base_output_directory={a['out']}", "run_name=oracle_train", "dataset_type=synthetic",
                "packing=False", "per_device_batch_size=1", f"max_target_length={a['seq']}", f"steps={a['steps']}",
                "dtype=float32", "weight_dtype=float32", "matmul_precision=highest", "enable_dropout=False",
                "enable_checkpointing=True", f"checkpoint_period={a['steps'] + 10}", "async_checkpointing=False",
                "enable_goodput_recording=False", "enable_checkpoint_cloud_logger=False", "monitor_goodput=False",
                *mf.COMMON_MT]
    runpy.run_module("maxtext.trainers.pre_train.train", run_name="__main__")


OPS = {"forward": mf.mt_forward, "train": train}

if __name__ == "__main__":
    OPS[sys.argv[1]](json.loads(sys.argv[2]))
