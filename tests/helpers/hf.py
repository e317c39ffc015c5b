"""transformers models as the reference: loading one, greedy generation, perplexity."""

from __future__ import annotations

import math

import torch


def load_hf_reference(path):
    """transformers loading the same GGUF, dequantized to fp32: the independent reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def load_hf_quantized_reference(path, scheme: str):
    """transformers on a SafeTensors checkpoint, every matmul weight replaced by its
    quantize-dequantize round trip through the gguf package: what `--quantize scheme` should
    compute (Q8_0 for int8; Q4_1 for int4, with the embedding and head at Q8_0)."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize, quantize
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 2:
                continue
            qtype = QT.Q8_0 if scheme == "int8" or "embed_tokens" in name or "lm_head" in name else QT.Q4_1
            w = p.detach().numpy()
            p.copy_(torch.from_numpy(dequantize(quantize(w, qtype), qtype).reshape(w.shape)))
    return model


def hf_greedy(hf, ids: list[int], n: int, stop_ids=frozenset()) -> list[int]:
    """Up to n greedy tokens from the transformers model with its own KV cache, ending before
    the first token in `stop_ids` (which, like a stop token in the engine, is not returned)."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(n):
            r = hf(x, past_key_values=past, use_cache=True)
            past = r.past_key_values
            token = int(r.logits[0, -1].argmax())
            if token in stop_ids:
                break
            out.append(token)
            x = torch.tensor([[token]])
    return out


def hf_perplexity(hf, ids: list[int], context: int, stride: int) -> float:
    """The sliding-window procedure of HF's perplexity guide, on the transformers model."""
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        trg = end - prev_end
        x = torch.tensor([ids[begin:end]])
        labels = x.clone()
        labels[:, :-trg] = -100
        with torch.inference_mode():
            logits = hf(x).logits.float()
        logp = torch.log_softmax(logits[0, :-1], -1)
        tgt = labels[0, 1:]
        keep = tgt != -100
        nll -= logp[keep].gather(1, tgt[keep, None]).sum().item()
        count += int(keep.sum())
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll / count)
