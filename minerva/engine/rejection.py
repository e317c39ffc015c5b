"""Rejection sampling for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

The target scores a request's pending token and its k guesses in one forward; `verify`
keeps a prefix of the guesses:

    accept guess d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
    draw from the normalized max(p_i - q_i, 0) and stop; if all k are accepted, draw a
    bonus token from p_{k+1}.

p_i is the target's distribution at position i after every sampling transform the
request asked for (`probabilities`, with penalties counting the guesses before i:
`states_along`), and q_i the distribution the guess was drawn from. Each emitted token is
then distributed exactly as without speculation; for greedy requests p_i is one-hot at the
argmax, so the output is token for token the same. Draws invert the CDF at one uniform from
the request's generator, as the sampler does (`sampler.invert_cdf`).

Guesses chosen deterministically (prompt lookup; a draft model's for a seeded request) have
q_i one-hot, and there `sample_along` gives the same outcome with the sampler's own draws:
the token at each position drawn as without guesses, a guess kept while it is the token
drawn. A seeded request's output is then the same token for token with or without guesses,
however many its steps verify.
"""

from __future__ import annotations

import torch

from minerva.engine.sampler import SamplerState, invert_cdf, process_batch, sample_batch


def probabilities(logits: torch.Tensor, states: list[SamplerState]) -> torch.Tensor:
    """Each row's sampling distribution (float64 [B, vocab]) after the request's transforms;
    greedy rows are one-hot at their argmax."""
    processed = process_batch(logits, states)
    probs = torch.softmax(processed.double(), -1)
    greedy = [i for i, s in enumerate(states) if s.params.greedy]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        probs[idx] = 0.0
        probs[idx, processed[idx].argmax(-1)] = 1.0
    return probs


def greedy_verify(logits: torch.Tensor, drafts: list[int], states: list[SamplerState]) -> list[int]:
    """`verify` for a greedy request, whose p_i are one-hot at the argmax of its processed
    logits (`probabilities`): the guesses while each is its row's argmax, then the argmax of
    the first row that disagrees (or of the last row). The same tokens, without the softmax
    over the vocabulary of every row (about 1 ms a step over 49152 tokens)."""
    return accepted(process_batch(logits, states).argmax(-1).tolist(), drafts)


def accepted(best: list[int], drafts: list[int]) -> list[int]:
    """A greedy request's tokens from its rows' argmax `best` (1 + len(drafts) of them, or
    one when it has no guesses): the guesses while each is its row's argmax, then the argmax
    of the row that disagrees (or of the last row)."""
    out = []
    for d, b in zip(drafts, best):
        if d != b:
            break
        out.append(d)
    out.append(best[len(out)])
    return out


def sample_along(logits: torch.Tensor, drafts: list[int], states: list[SamplerState]) -> list[int]:
    """`verify` for guesses chosen deterministically (q_i one-hot), from the rows' logits
    (masked by a grammar where there is one): each position's token is drawn as the sampler
    draws it (`sample_batch`, one uniform from the request's generator), and a guess is kept
    while it is the token drawn. A guess d is kept with probability p(d), and at the first miss
    the token drawn follows p without d: rejection sampling's outcome, with one draw per token
    emitted, the draws the request makes without guesses."""
    out = []
    for i, state in enumerate(states[:len(drafts) + 1]):
        out.append(sample_batch(logits[i:i + 1], [state])[0])
        if i == len(drafts) or out[-1] != drafts[i]:
            break
    return out


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A token from one (unnormalized) distribution row, by inverting its CDF at one uniform."""
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device)
    return int(invert_cdf(probs[None], u)[0])


def states_along(state: SamplerState, drafts: list[int]) -> list[SamplerState]:
    """The request's sampler state at each of the 1 + k verified positions: position i has
    seen the guesses before it (penalties count them as if they had been generated)."""
    p = state.params
    if p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty:
        return [state] * (len(drafts) + 1)
    out = [state]
    seen, generated = dict(state.seen), dict(state.generated)
    for d in drafts:
        seen[d] = None
        generated[d] = generated.get(d, 0) + 1
        out.append(SamplerState(p, state.generator, dict(seen), dict(generated)))
    return out


def verify(p: torch.Tensor, drafts: list[int], q: torch.Tensor, generator: torch.Generator) -> list[int]:
    """Rejection sampling. p [k + 1, vocab]: target distributions at the k guesses and after
    them; q [k, vocab] the distributions the guesses were drawn from (`sample_along` where
    they were chosen deterministically). Returns the accepted guesses plus one token."""
    out = []
    for i, d in enumerate(drafts):
        pd, qd = float(p[i, d]), float(q[i, d])
        u = float(torch.rand(1, generator=generator, dtype=torch.float64, device=p.device))
        if qd > 0 and u * qd < pd:  # accept with probability min(1, p/q)
            out.append(d)
            continue
        residual = (p[i].clone() - q[i].to(p.dtype)).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p <= q everywhere only when p == q: then d was accepted
            residual = p[i]
        out.append(draw(residual, generator))
        return out
    out.append(draw(p[len(drafts)], generator))
    return out
