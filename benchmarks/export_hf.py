"""Write a GGUF model out as a Hugging Face SafeTensors directory (dequantized by transformers).

The result is a real float checkpoint to try `--quantize int8|int4` on, or to pair with
its GGUF as a draft model:

    python benchmarks/export_hf.py smollm2-135m /tmp/smollm2-hf --dtype bfloat16
    minerva perplexity /tmp/smollm2-hf tests/data/prose.txt --quantize int4
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minerva.store import resolve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="pulled name or .gguf path")
    p.add_argument("out", help="directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args()
    path = resolve(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=getattr(torch, args.dtype))
    # transformers marks a model read from GGUF as quantized and refuses to save it:
    # copy its (already dequantized) weights into a plain model of the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(args.out)
    print(f"wrote {args.out} ({args.dtype})")


if __name__ == "__main__":
    main()
