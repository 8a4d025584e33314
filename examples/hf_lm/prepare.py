"""Write ``train.bin`` and ``val.bin`` as nanoGPT's ``prepare.py`` does (raw uint16 token ids, no header), here with
bytes as tokens (a vocabulary of 256) of standard-library modules' source text: no download, no tokenizer.

    python examples/hf_lm/prepare.py data/hf_lm            # then dataset: {name: tokens, root: data/hf_lm}

With your own tokenizer: ``np.array(ids, np.uint16).tofile("train.bin")`` (``np.uint32`` and
``dataset.token_dtype: uint32`` for a vocabulary over 65,536).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import numpy as np

MODULES = ["json.decoder", "json.encoder", "argparse", "textwrap", "string", "difflib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write train.bin and val.bin into")
    parser.add_argument("--modules", nargs="+", default=MODULES, help="standard-library modules whose source to use")
    parser.add_argument("--val-fraction", type=float, default=0.1)
    args = parser.parse_args()
    text = b"".join(Path(importlib.util.find_spec(m).origin).read_bytes() for m in args.modules)
    ids = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
    cut = int(len(ids) * (1 - args.val_fraction))
    args.out.mkdir(parents=True, exist_ok=True)
    ids[:cut].tofile(args.out / "train.bin")
    ids[cut:].tofile(args.out / "val.bin")
    print(f"wrote {args.out}/train.bin ({cut:,} tokens) and val.bin ({len(ids) - cut:,} tokens), vocabulary 256")


if __name__ == "__main__":
    main()
