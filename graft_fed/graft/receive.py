"""The receiver's side of GRAFT (docs/algorithm.md steps 7-10, and "Stored peers").

Given this model's own groups for a step and, for some of its all-fail prompts, a peer's
group record, it re-verifies the peer's rewards with its own verifier, uses its own
tokenisation of its own rendered prompt, re-tokenises every peer response string with its
own tokenizer, scores compatibility with one likelihood pass of its old policy, and
replaces the failed group by the peer group with the source's advantages and the gate's
weights. It needs only what `Receiver` holds, not a trainer.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from graft_fed.core.exchange import Quantiles, compatibility, complementarity, gate_weights, plan_transfer
from graft_fed.core.records import GroupRecord
from graft_fed.core.screening import ScreeningError, ScreenSettings, screen_record
from graft_fed.rollout.base import Completion
from graft_fed.trainer.config import GraftSection
from graft_fed.trainer.group import Group

#: The receiver's old policy on (prompt ids, response ids) pairs: the mean token log-prob of
#: each response (Eq. 6, shape (B,)) and every response token's log-prob.
ScoreFn = Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]]], tuple[torch.Tensor, list[list[float]]]]


@dataclass(frozen=True)
class Receiver:
    """What receiving peer groups needs from the model that receives them."""

    tokenizer: Any
    eos_id: int
    verifier: Any  # graft_fed.rewards.Verifier: score(texts, answers).rewards
    score: ScoreFn
    graft: GraftSection
    scale_rewards: str = "group"  # how the receiver computes advantages (the pooled ablation)
    std: str = "sample"
    #: The most tokens (the receiver's own) of one peer response it trains on, and the most
    #: prompt + response tokens its model takes (its context); None = no bound. A peer group
    #: with a longer response is refused before any model sees it: a hostile peer could
    #: otherwise send responses of 256 Ki characters that crash the scoring pass (out of
    #: memory, or positions past the model's context).
    max_response_tokens: int | None = None
    context_tokens: int | None = None

    def response_limit(self, prompt_tokens: int) -> int | None:
        """The most tokens a peer response to a prompt of `prompt_tokens` tokens may have."""
        limits = [x for x in (self.max_response_tokens,
                              None if self.context_tokens is None else self.context_tokens - prompt_tokens)
                  if x is not None]
        return min(limits) if limits else None


def retokenise(tokenizer: Any, text: str, finish_reason: str, eos_id: int) -> list[int]:
    """The receiver's own token ids for a peer response string (never the peer's ids).
    A response that stopped gets the receiver's EOS so the receiver learns to stop.
    Special-token strings in the text ("<|im_end|>", "<|endoftext|>", the pad token) are
    read as the plain text they are, never as those tokens: responses are decoded without
    special tokens, so only a hostile peer's text makes them, and it would otherwise put
    end-of-turn, role or pad tokens inside what the receiver trains on."""
    ids = list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    if finish_reason == "stop" or not ids:
        ids.append(eos_id)
    return ids


@dataclass(frozen=True)
class GroupReport:
    """What the receiver learnt about one offered group (reported back to the broker)."""

    prompt_id: str
    source: str
    mean_s: float
    admitted_fraction: float
    rejected: bool  # re-verification disagreed with the claimed rewards


@dataclass
class ReceiveResult:
    groups: list[Group]  # the step's groups with replacements made, in the original order
    metrics: dict[str, Any]
    reports: list[GroupReport]


def receive(rx: Receiver, own: Sequence[Group], offers: Mapping[str, GroupRecord]) -> ReceiveResult:
    """Replace own all-fail groups by the offered peer groups (one source group per prompt)."""
    g = rx.graft
    t0 = time.perf_counter()
    counts: dict[str, float] = defaultdict(float)
    per_source: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    index = {grp.prompt.id: i for i, grp in enumerate(own)}
    reports: list[GroupReport] = []
    accepted: list[tuple[int, GroupRecord]] = []
    advantages: dict[str, tuple[float, ...]] = {}  # prompt id -> what the receiver trains on
    screen = ScreenSettings(scale=rx.scale_rewards, std=rx.std)

    def refuse(rec: GroupRecord, reason: str, lied: bool, source_key: str = "") -> None:
        """A peer group not trained on: counted, and reported as a lie (s NaN) or as unusable (s 0)."""
        counts[f"rejected_{reason}"] += 1
        per_source[rec.model_id][source_key or f"rejected_{reason}"] += 1
        reports.append(GroupReport(rec.prompt_id, rec.model_id, math.nan if lied else 0.0, 0.0, lied))

    # in the order of the receiver's own groups, whatever order the peers delivered them in
    for pid, rec in sorted(offers.items(), key=lambda kv: (index.get(kv[0], len(own)), kv[0])):
        counts["offered"] += 1
        i = index.get(pid)
        if i is None or own[i].k != 0:
            counts["rejected_not_all_fail"] += 1  # a receiver never takes a group it did not need
            continue
        try:
            # Everything checkable without a model (docs/security.md): the record's shape,
            # claimed log-probs a model can produce, and claimed advantages equal to Eq. 1 on
            # the claimed rewards (which re-verification below must then confirm): the
            # receiver trains on its own recomputation, never on the claim.
            advantages[pid] = screen_record(rec, screen)
        except ScreeningError as exc:
            refuse(rec, exc.reason, lied=True, source_key="rejected")
            continue
        if rec.kind != "informative" and g.transfer != "pooled":
            counts["rejected_uninformative"] += 1
            continue
        accepted.append((i, rec))

    # Re-verify every peer response against OUR answer with OUR verifier (section 3).
    if g.reverify and accepted:
        texts = [t for _, rec in accepted for t in rec.texts]
        answers = [own[i].prompt.answer for i, rec in accepted for _ in rec.texts]
        result = rx.verifier.score(texts, answers)
        scored = result.rewards
        statuses = list(getattr(result, "statuses", None) or ())
        counts["reverified"] += len(accepted)
        kept, pos = [], 0
        for i, rec in accepted:
            mine = scored[pos:pos + rec.n]
            unverified = sum(1 for st in statuses[pos:pos + rec.n] if st in ("timeout", "error"))
            pos += rec.n
            if unverified:
                # a response this verifier could not finish is not verified, whatever was
                # claimed (a hostile peer's "9^{9^{9^9}}" claimed 0 costs the verifier's whole
                # timeout and passed): not trained on, reported as unusable (s 0), not as a
                # lie, so the source stops being the most compatible one for this receiver
                refuse(rec, "unverifiable", lied=False)
                continue
            if [float(r) for r in mine] != [float(r) for r in rec.rewards]:
                refuse(rec, "reverify", lied=True)
                continue
            kept.append((i, rec))
        accepted = kept

    # Re-tokenise and score compatibility in one batched likelihood pass of pi_old^R.
    eos = rx.eos_id
    plans, prompt_ids, resp_ids, owners = [], [], [], []
    kept = []
    for i, rec in accepted:
        plan = plan_transfer(rec.rewards, advantages[own[i].prompt.id], g.transfer,  # type: ignore[arg-type]
                             own_rewards=own[i].rewards.tolist() if g.transfer == "pooled" else (),
                             scale=rx.scale_rewards, std=rx.std)
        ids = {j: retokenise(rx.tokenizer, rec.texts[j], rec.finish_reasons[j], eos)
               for j in plan.peer_index if j is not None}
        limit = rx.response_limit(len(own[i].prompt_ids))
        if limit is not None and any(len(r) > limit for r in ids.values()):
            # not trained on; reported as unusable (s 0), not as a lie: an honest peer with a
            # longer response cap than this receiver's sends such groups too
            refuse(rec, "too_long", lied=False)
            continue
        kept.append((i, rec))
        plans.append(plan)
        for j in plan.peer_index:
            if j is None:
                continue
            prompt_ids.append(own[i].prompt_ids)
            resp_ids.append(ids[j])
            owners.append((len(plans) - 1, j))
    accepted = kept
    lbar_r = torch.empty(0)
    token_lps: list[list[float]] = []
    if resp_ids:
        lbar_r, token_lps = rx.score(prompt_ids, resp_ids)
    src_lbar = torch.tensor([accepted[p][1].mean_logprobs[j] for p, j in owners], dtype=torch.float32)
    s_all = compatibility(lbar_r, src_lbar) if resp_ids else torch.empty(0)
    w_all = gate_weights(s_all, g.delta, g.gate) if resp_ids else torch.empty(0)

    out = list(own)
    cursor = 0
    s_values: list[float] = []
    for (i, rec), plan in zip(accepted, plans):
        completions, rewards, weights, from_peer = [], [], [], []
        group_s: list[float] = []
        for j, adv in zip(plan.peer_index, plan.advantages):
            if j is None:
                c = own[i].completions[len(completions)]
                completions.append(c)
                rewards.append(0.0)
                weights.append(1.0)
                from_peer.append(False)
                continue
            s_val, w_val = float(s_all[cursor]), float(w_all[cursor])
            completions.append(Completion(text=rec.texts[j], token_ids=resp_ids[cursor],
                                          logprobs=token_lps[cursor], finish_reason=rec.finish_reasons[j],  # type: ignore[arg-type]
                                          prompt_token_ids=list(own[i].prompt_ids)))
            rewards.append(rec.rewards[j])
            weights.append(w_val)
            from_peer.append(True)
            s_values.append(s_val)
            group_s.append(s_val)
            src = per_source[rec.model_id]
            src["peer_responses"] += 1
            src["admitted"] += 1.0 if w_val > 0 else 0.0
            src["s_sum"] += s_val
            cursor += 1
        if not any(w > 0 for w, fp in zip(weights, from_peer) if fp):
            counts["replaced_all_dropped"] += 1
        out[i] = Group(prompt=own[i].prompt, prompt_ids=own[i].prompt_ids, completions=completions,
                       rewards=torch.tensor(rewards), advantages=torch.tensor(plan.advantages, dtype=torch.float32),
                       weights=torch.tensor(weights, dtype=torch.float32), source=rec.model_id, from_peer=from_peer)
        counts["replaced"] += 1
        per_source[rec.model_id]["replaced"] += 1
        admitted_here = sum(1 for w, fp in zip(weights, from_peer) if fp and w > 0)
        family = own[i].prompt.meta.get("family")
        if family is not None:  # which slices each peer fills (e.g. a withheld sub-skill)
            per_source[rec.model_id][f"family/{family}/replaced"] += 1
            per_source[rec.model_id][f"family/{family}/admitted"] += admitted_here
        reports.append(GroupReport(rec.prompt_id, rec.model_id,
                                   sum(group_s) / len(group_s) if group_s else math.nan,
                                   admitted_here / len(group_s) if group_s else 0.0, False))

    peer_resp = sum(src["peer_responses"] for src in per_source.values())
    admitted = sum(src["admitted"] for src in per_source.values())
    q = Quantiles.of(s_values)
    metrics: dict[str, Any] = {f"graft/{k}": v for k, v in counts.items()}
    metrics.update({
        "graft/peer_responses": peer_resp,
        "graft/admitted_frac": admitted / peer_resp if peer_resp else float("nan"),
        "graft/s_p10": q.p10, "graft/s_p50": q.p50, "graft/s_p90": q.p90,
        "graft/s_values": [round(v, 4) for v in s_values],
        "time/graft": time.perf_counter() - t0,
    })
    for name, src in per_source.items():
        metrics[f"graft/from/{name}/replaced"] = src["replaced"]
        metrics.update({f"graft/from/{name}/{key}": v for key, v in src.items() if key.startswith("family/")})
        if src["peer_responses"]:
            metrics[f"graft/from/{name}/admitted_frac"] = src["admitted"] / src["peer_responses"]
            metrics[f"graft/from/{name}/s_mean"] = src["s_sum"] / src["peer_responses"]
    return ReceiveResult(groups=out, metrics=metrics, reports=reports)


def offer_metrics(own: Sequence[Group], candidates: int, solved: int, selected: int,
                  prefix: str = "graft") -> dict[str, float]:
    """Diagnostics of what was offered to a receiver: its all-fail groups, candidates (its
    all-fail prompts with an informative peer group), selected, and complementarity (the
    share of its all-fail prompts a peer solved at least once; the paper: 47.9% / 18.7%)."""
    all_fail = sum(1 for grp in own if grp.k == 0)
    return {
        f"{prefix}/all_fail": float(all_fail),
        f"{prefix}/candidates": float(candidates),
        f"{prefix}/selected": float(selected),
        f"{prefix}/complementarity": solved / all_fail if all_fail else float("nan"),
    }


def own_complementarity(own: Sequence[Group], sources: Sequence[Mapping[str, tuple[int, int]]]) -> tuple[int, int]:
    """(candidates, solved) of `own`'s all-fail prompts against peers' (k, n) per prompt."""
    return complementarity({g.prompt.id: (g.k, g.n) for g in own},
                           ((pid, k, n) for src in sources for pid, (k, n) in src.items()))
