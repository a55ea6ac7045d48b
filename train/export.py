"""Export a run's newest checkpoint as a Hugging Face model directory.

    python -m train.export RUN_DIR OUT_DIR

writes OUT_DIR as `save_pretrained` does (config.json, model.safetensors, generation config) plus the
run's tokenizer (tokenizer.json, tokenizer_config.json), so that, offline,

    GPTNeoXForCausalLM.from_pretrained(OUT_DIR); AutoTokenizer.from_pretrained(OUT_DIR)

load the trained model. The weights are the checkpoint's: rank N-1's, the replica that holds the exact
aggregate under CERAR. The architecture and tokenizer come from the config the checkpoint records (or, for
checkpoints older than that record, the run directory's .hydra/config.yaml): data=embedded/local export the
byte-level BPE cached under data.cache_dir; data=pile the tokenizer named by data.tokenizer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # python train/export.py: import `train` from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from omegaconf import OmegaConf

from train import checkpoint as ckpt
from train.config import UserError


class ExportError(UserError):
    """The run directory cannot be exported (no checkpoint, no config, no tokenizer)."""


def run_config(run_dir: Path, state: dict):
    """The run's resolved config: the checkpoint's record, else the Hydra config saved in the run dir."""
    if state.get("config") is not None:
        return OmegaConf.create(state["config"])
    saved = run_dir / ".hydra" / "config.yaml"
    if saved.exists():
        return OmegaConf.load(saved)
    raise ExportError(f"the checkpoint records no config and {saved} does not exist")


def export_tokenizer(cfg, out_dir: Path) -> None:
    """Save the run's tokenizer into out_dir in the form AutoTokenizer.from_pretrained reads."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    d = cfg.data
    if d.kind == "pile":
        tokenizer = AutoTokenizer.from_pretrained(d.tokenizer)
    else:
        from train.data import EOS_TOKEN, bpe_tokenizer_file

        path = bpe_tokenizer_file(d)
        if not path.exists():
            raise ExportError(f"the run's tokenizer {path} is missing (data.cache_dir={d.cache_dir})")
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=str(path), eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, unk_token=EOS_TOKEN
        )
    tokenizer.model_max_length = int(cfg.model.max_position_embeddings)
    tokenizer.save_pretrained(out_dir)


def export(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the newest valid checkpoint of run_dir to out_dir as a HF model + tokenizer; return its path."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    loaded = ckpt.load_latest_checkpoint(run_dir)
    if loaded is None:
        raise ExportError(f"{ckpt.checkpoint_dir(run_dir)} holds no valid checkpoint to export")
    state, path = loaded
    cfg = run_config(run_dir, state)
    import torch  # transformers only now: a refusal above comes in a second, not after its import
    from transformers import GPTNeoXForCausalLM

    from train.model import gpt_neox_config

    config = gpt_neox_config(cfg.model)
    config.use_cache = True  # for generation by whoever loads the export
    with torch.device("meta"):
        model = GPTNeoXForCausalLM(config)
    model.load_state_dict(state["model"], assign=True)
    model.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    export_tokenizer(cfg, out_dir)
    print(f"exported {path} (step {state.get('step')}, {cfg.model.name}) to {out_dir}")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a training run directory (holding checkpoints/)")
    parser.add_argument("out_dir", help="where to write the Hugging Face model directory")
    args = parser.parse_args(argv)
    try:
        export(args.run_dir, args.out_dir)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
