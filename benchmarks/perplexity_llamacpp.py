"""llama.cpp's perplexity on the same token ids and windows as `minerva perplexity`.

    python benchmarks/perplexity_llamacpp.py smollm2-135m tests/data/prose.txt --context 256 --stride 128

The text is tokenized by Minerva (the same ids for both engines), then each sliding window
(minerva.engine.perplexity's: windows of --context tokens every --stride, each scoring the
tokens the previous one did not) is evaluated by llama-cpp-python from an empty cache with
every position's logits kept; the log-softmax is taken in float64. llama.cpp multiplies
quantized weights by 8-bit activations, so this is the figure `--activations int8` is
compared with. Needs `pip install -e '.[bench]'`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="pulled name or .gguf file")
    ap.add_argument("file", help="text file")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--stride", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    from llama_cpp import Llama

    from minerva.formats.tokenizer import Tokenizer
    from minerva.formats.gguf import GGUFFile
    from minerva.store import resolve

    path = resolve(args.model)
    ids = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata).encode(Path(args.file).read_text(encoding="utf-8"))
    stride = args.stride or args.context
    llm = Llama(str(path), n_ctx=args.context, n_batch=args.context, logits_all=True, verbose=False,
                n_threads=args.threads)
    nll, scored, windows, prev_end = 0.0, 0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + args.context, len(ids))
        window = ids[begin:end]
        num_scored = min(end - prev_end, len(window) - 1)
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[:len(window)], dtype=np.float64)
        for p in range(len(window) - 1 - num_scored, len(window) - 1):  # position p predicts p + 1
            row = logits[p]
            top = row.max()
            nll -= row[window[p + 1]] - top - math.log(np.exp(row - top).sum())
        scored += num_scored
        windows += 1
        prev_end = end
        if end == len(ids):
            break
    print(f"llama.cpp perplexity {math.exp(nll / scored):.4f}  (nll {nll / scored:.4f} nats/token over "
          f"{scored} tokens, {windows} windows, context {args.context}, stride {stride})")


if __name__ == "__main__":
    main()
