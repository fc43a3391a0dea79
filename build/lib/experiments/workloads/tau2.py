"""τ²-bench-shaped agentic RL batches (AReaL ``examples/tau2`` sampling).

The figures below were measured from the public tau2-bench repository (domain prefixes in
DeepSeek-V3 BPE tokens, within ~3 % of Qwen3's tokenizer; task counts; tool result sizes) and
AReaL's tau2 example configuration; they are copied here as constants.

One batch = B tasks × G rollouts (episodes). An episode is T = 2 + NegBin(mean 10, k 4)
agent calls (at most 25); call j < T is a tool call with probability ``p_tool`` (else a
message to the user) and is answered by the environment (tool result or user reply); the
last call is a message. Every call outputs ``thinking + response`` wrapped in 8 template
tokens; earlier calls' thinking is dropped from later prompts. The group's rollouts share the
domain prefix P and the first user message u1, and diverge at call 1's thinking; with
probability 0.5 / 0.35 / 0.15 their first 0 / 1 / 2 visible calls (response + environment
reply) are identical as well.

Exports:

* ``per-call`` (AReaL's): one sequence per call, ``P · u1 · trunk_1 … trunk_{i-1} · leaf_i``
  with ``trunk_j = response_j + 5 template tokens + env_j`` and
  ``leaf_i = [2] thinking_i [4] response_i [2]`` (the bracketed template tokens); the loss
  mask is 1 on ``leaf_i`` only.
* ``concat``: one sequence per episode, ``P · u1 · leaf_1 · env_1 · leaf_2 … leaf_T``
  (thinking kept), loss mask 1 on every ``leaf_i``.

Reward: one Bernoulli(p_task) per episode, p_task ~ U(0.1, 0.9); the GRPO-normalized
advantage of the episode is stored on every token of every sequence of the episode.
Behaviour log-probs (``logprobs``): synthetic negative values on trainable tokens, 0
elsewhere, a deterministic function of the segment like the ids.

Measured sharing ratio (total / unique prefix-tree tokens, whole batch, full scale, seeds
0-7; reference figures in brackets): airline per-call 9.52-9.75, mean 9.66 [9.2-9.5];
retail 9.38-9.86, mean 9.56 [9.2-9.5]; telecom 12.45-13.26, mean 13.0 [12.4-12.7]; airline
no thinking 21.6-23.0, mean 22.3 [21-22]; airline concat 1.57-1.64 [1.6]; telecom concat
no thinking 3.79-4.42, mean 4.07 [4.1]. An independent length-only Monte Carlo of the same
table gives the same means (airline 9.67 ± 0.17 per seed), so the few-percent excess of the
per-call rows is in the table's parameters, not in this code. Airline batch, seed 0: 1,555
sequences, prompt p50 6.4K / p90 9.4K / max 15.3K, completion p50 372 / p90 990; trainable
tokens 7.0 % of all and 68 % of unique ones [1,536; 6.4K / 8.6K / 13.8K; 389 / 1,016;
7.5 %, 69 %]. Generation takes about a second.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from experiments.workloads.base import (
    DEFAULT_VOCAB_SIZE,
    Scale,
    Tokens,
    Workload,
    code,
    grpo_advantages,
    resolve_scale,
    scaled_lengths,
)

__all__ = ["Domain", "DOMAINS", "generate_tau2"]


@dataclass(frozen=True)
class Domain:
    prefix_tokens: int  # system turn: instructions + policy + tool schemas + greeting
    n_tasks: int
    p_tool: float  # probability that a non-final call is a tool call


DOMAINS = {
    "airline": Domain(4906, 50, 0.50),
    "retail": Domain(4865, 114, 0.55),
    "telecom": Domain(7308, 2285, 0.30),
    "mock": Domain(726, 10, 0.50),  # p_tool not measured for mock: airline's value
}

# Lengths: (constant template tokens, LogNormal median, sigma, clip lo, clip hi); the clip
# applies to the LogNormal part, the constant is added on top.
FIRST_USER = (5, 45, 0.5, 15, 200)
THINKING = (0, 300, 0.9, 0, 8192)
TOOL_CALL = (0, 35, 0.3, 20, 120)
MESSAGE = (0, 70, 0.6, 10, 600)
TOOL_RESULT = (12, 250, 0.8, 5, 4000)
USER_REPLY = (8, 40, 0.6, 5, 400)
CALLS_MIN, CALLS_MEAN, CALLS_K, CALLS_CAP = 2, 10.0, 4, 25
SHARED_VISIBLE_CALLS_P = (0.5, 0.35, 0.15)  # P(first 0 / 1 / 2 visible calls identical)
TASKS, GROUP = 16, 8

# Template segments (fixed content; the counts are the measured ones).
_TEMPLATES = {
    "turn-end": 5,  # <|im_end|>\n<|im_start|>assistant\n: ends u1 and every env message
    "tool-head": 7,  # tool result header: 7 + body + turn-end 5 = 12
    "user-head": 3,  # user reply header: 3 + body + turn-end 5 = 8
    "trunk-tool": 5,  # after a visible tool call in later prompts
    "trunk-msg": 5,  # after a visible message in later prompts
    "leaf-head": 2,  # <think>\n
    "leaf-mid": 4,  # \n</think>\n\n
    "leaf-tail": 2,  # <|im_end|>\n
}
_K = {k: code(k) for k in ("tau2", "prefix", "u1", "think", "resp", "env", "tmpl", "group")}
_SHARED = 2**31  # episode slot of a segment shared by the whole group


def _length(rng, n, spec, factor, min_lo=1):
    const, median, sigma, lo, hi = spec
    return const, scaled_lengths(rng, n, median, sigma, lo, hi, factor, min_lo)


def generate_tau2(domain: str, scale: str | float | Scale = "full", seed: int = 0, *,
                  export: str = "per-call", thinking: bool = True, tasks: int | None = None,
                  group_size: int | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE,
                  logprobs: bool = True, max_calls: int | None = None,
                  progress: bool = False) -> Workload:
    """One τ²-shaped batch of ``domain`` (airline, retail, telecom, mock); see module doc.

    ``tasks`` (B) and ``group_size`` (G) override the scale's; ``max_calls`` overrides the cap
    on calls per episode. Deterministic in all arguments.
    """
    if domain not in DOMAINS:
        raise ValueError(f"unknown tau2 domain {domain!r}; known: {', '.join(DOMAINS)}")
    if export not in ("per-call", "concat"):
        raise ValueError(f"export must be 'per-call' or 'concat', got {export!r}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    dom, sc, tok = DOMAINS[domain], resolve_scale(scale), Tokens(vocab_size)
    B = int(tasks or max(1, round(TASKS * sc.tasks)))
    G = int(group_size or max(2, round(GROUP * sc.group)))
    calls_mean = CALLS_MEAN * sc.calls
    cap = int(max_calls or max(3, round(CALLS_CAP * sc.calls)))
    if B < 1 or G < 1 or cap < CALLS_MIN:
        raise ValueError(f"need tasks >= 1, group_size >= 1, max_calls >= {CALLS_MIN}")
    d = code(domain)
    lp = logprobs
    tmpl = {k: tok.ids((_K["tmpl"], code(k)), n) for k, n in _TEMPLATES.items()}
    tmpl_lp = {k: tok.logprobs((_K["tmpl"], code(k)), n, 0.01) for k, n in _TEMPLATES.items()}
    P = tok.ids((_K["prefix"], d), max(1, round(dom.prefix_tokens * sc.prefix)))

    # The batch's tasks: drawn without replacement from the domain's pool (cycling when the
    # batch is larger); a task's first user message depends on the task only.
    pick = np.random.default_rng([_K["tau2"], _K["group"], d, seed])
    task_ids = np.concatenate([pick.permutation(dom.n_tasks)
                               for _ in range(-(-B // dom.n_tasks))])[:B]

    def segment(kind, ident, n, with_lp):
        key = (_K[kind], d, *ident)
        return tok.ids(key, n), (tok.logprobs(key, n) if with_lp else None)

    def env_segment(is_tool, ident, n):
        body, _ = segment("env", ident, n, False)
        return np.concatenate([tmpl["tool-head" if is_tool else "user-head"], body,
                               tmpl["turn-end"]])

    records: list[dict] = []
    groups = range(B)
    if progress:
        from tqdm import tqdm
        groups = tqdm(groups, desc=f"tau2-{domain}", unit="task")
    for b in groups:
        task = int(task_ids[b])
        u1_rng = np.random.default_rng([_K["u1"], d, task])
        _, (u1_len,) = _length(u1_rng, 1, FIRST_USER, sc.length)
        u1 = np.concatenate([segment("u1", (task,), u1_len, False)[0], tmpl["turn-end"]])
        base = np.concatenate([P, u1])

        g_rng = np.random.default_rng([_K["tau2"], _K["group"], d, seed, b])
        n_shared = int(g_rng.choice(3, p=SHARED_VISIBLE_CALLS_P))
        sh_tool = g_rng.random(2) < dom.p_tool
        sh_resp = np.where(sh_tool, _length(g_rng, 2, TOOL_CALL, sc.length)[1],
                           _length(g_rng, 2, MESSAGE, sc.length)[1])
        sh_env = np.where(sh_tool, _length(g_rng, 2, TOOL_RESULT, sc.length)[1],
                          _length(g_rng, 2, USER_REPLY, sc.length)[1])
        success = g_rng.random(G) < g_rng.uniform(0.1, 0.9)  # the episodes' rewards (0/1)
        advantages = grpo_advantages(success)

        for e in range(G):
            rng = np.random.default_rng([_K["tau2"], d, seed, b, e])
            T = min(cap, CALLS_MIN + int(rng.negative_binomial(CALLS_K, CALLS_K / (CALLS_K + calls_mean))))
            is_tool = rng.random(T) < dom.p_tool
            is_tool[-1] = False  # the last call is a message
            resp = np.where(is_tool, _length(rng, T, TOOL_CALL, sc.length)[1],
                            _length(rng, T, MESSAGE, sc.length)[1])
            env = np.where(is_tool, _length(rng, T, TOOL_RESULT, sc.length)[1],
                           _length(rng, T, USER_REPLY, sc.length)[1])
            think = _length(rng, T, THINKING, sc.length, min_lo=0)[1]
            if not thinking:
                think[:] = 0
            k = min(n_shared, T - 1)  # shared visible calls (never the final message)
            is_tool[:k], resp[:k], env[:k] = sh_tool[:k], sh_resp[:k], sh_env[:k]

            leaves, leaf_lps, trunks, envs = [], [], [], []
            for j in range(T):
                slot = _SHARED if j < k else e
                r_ids, r_lp = segment("resp", (seed, b, slot, j), resp[j], lp)
                t_ids, t_lp = segment("think", (seed, b, e, j), think[j], lp)
                leaves.append(np.concatenate([tmpl["leaf-head"], t_ids, tmpl["leaf-mid"], r_ids,
                                              tmpl["leaf-tail"]]))
                if lp:
                    leaf_lps.append(np.concatenate([tmpl_lp["leaf-head"], t_lp, tmpl_lp["leaf-mid"],
                                                    r_lp, tmpl_lp["leaf-tail"]]))
                if j < T - 1:
                    envs.append(env_segment(is_tool[j], (seed, b, slot, j), env[j]))
                    trunks.append(np.concatenate(
                        [r_ids, tmpl["trunk-tool" if is_tool[j] else "trunk-msg"], envs[-1]]))

            common = {"group_id": b, "episode": b * G + e, "task": task, "calls": T,
                      "reward": float(success[e])}
            adv = float(advantages[e])
            if export == "per-call":
                context = np.concatenate([base, *trunks])
                offsets = len(base) + np.concatenate([[0], np.cumsum([len(t) for t in trunks])])
                for i in range(T):
                    off, leaf = int(offsets[i]), leaves[i]
                    records.append(_record(np.concatenate([context[:off], leaf]), off,
                                           leaf_lps[i] if lp else None, adv,
                                           {**common, "call": i}))
            else:
                parts, mask_parts, lp_parts = [base], [np.zeros(len(base), np.int8)], [np.zeros(len(base))]
                for j in range(T):
                    parts.append(leaves[j])
                    mask_parts.append(np.ones(len(leaves[j]), np.int8))
                    lp_parts.append(leaf_lps[j] if lp else np.zeros(len(leaves[j])))
                    if j < T - 1:
                        parts.append(envs[j])
                        mask_parts.append(np.zeros(len(envs[j]), np.int8))
                        lp_parts.append(np.zeros(len(envs[j])))
                ids = np.concatenate(parts)
                rec = {"input_ids": ids, "loss_mask": np.concatenate(mask_parts),
                       "advantages": np.full(len(ids), adv), **common}
                if lp:
                    rec["logprobs"] = np.concatenate(lp_parts)
                records.append(rec)

    params = dict(workload=f"tau2-{domain}", domain=domain, scale=sc.name, seed=seed,
                  export=export, thinking=thinking, tasks=B, group_size=G, vocab_size=vocab_size,
                  prefix_tokens=len(P), calls_mean=CALLS_MIN + calls_mean, max_calls=cap,
                  p_tool=dom.p_tool, logprobs=logprobs, length_scale=sc.length)
    return Workload(f"tau2-{domain}" + ("-concat" if export == "concat" else ""), records, params)


def _record(ids: np.ndarray, prompt_len: int, leaf_lp, adv: float, extra: dict) -> dict:
    n = len(ids)
    mask = np.zeros(n, np.int8)
    mask[prompt_len:] = 1
    rec = {"input_ids": ids, "loss_mask": mask, "advantages": np.full(n, adv), **extra}
    if leaf_lp is not None:
        lps = np.zeros(n)
        lps[prompt_len:] = leaf_lp
        rec["logprobs"] = lps
    return rec
