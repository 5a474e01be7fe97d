"""The proto codec: federation messages (graft_fed/federation/messages.py) <-> wire messages.

Only this module, the broker's servicer and the node's client touch graft_fed.proto.
"""

from __future__ import annotations

from typing import Sequence

from graft_fed.federation.manifest import Manifest
from graft_fed.federation.messages import MatchResult, Offer, Privacy, ReportEntry, SummaryRow
from graft_fed.proto import broker_pb2 as pb

MODES = {pb.MODE_SYNC: "sync", pb.MODE_ASYNC: "async"}
MODE_CODES = {v: k for k, v in MODES.items()}
PRIVACY = {pb.PRIVACY_SHARE_ALL: Privacy.SHARE_ALL.value, pb.PRIVACY_MATCHED_ONLY: Privacy.MATCHED_ONLY.value,
           pb.PRIVACY_SUMMARIES_ONLY: Privacy.SUMMARIES_ONLY.value}
PRIVACY_CODES = {v: k for k, v in PRIVACY.items()}


def manifest_to_pb(m: Manifest) -> pb.Manifest:
    return pb.Manifest(federation_id=m.federation_id, protocol_version=m.protocol_version, dataset_id=m.dataset_id,
                       dataset_hash=m.dataset_hash, seed=m.seed, n=m.n, prompts_per_round=m.prompts_per_round,
                       mode=MODE_CODES.get(m.mode, pb.MODE_UNSPECIFIED), verifier_name=m.verifier_name,
                       verifier_version=m.verifier_version, staleness_rounds=m.staleness_rounds)


def manifest_from_pb(m: pb.Manifest) -> Manifest:
    return Manifest(federation_id=m.federation_id, protocol_version=m.protocol_version, dataset_id=m.dataset_id,
                    dataset_hash=m.dataset_hash, seed=m.seed, n=m.n, prompts_per_round=m.prompts_per_round,
                    mode=MODES.get(m.mode, ""), verifier_name=m.verifier_name, verifier_version=m.verifier_version,
                    staleness_rounds=m.staleness_rounds)


def privacy_from_pb(code: int) -> str:
    """The privacy level's name; "" for a code this version does not know (the broker refuses it)."""
    return PRIVACY.get(code, "")


def summary_to_pb(s: SummaryRow) -> pb.GroupSummary:
    return pb.GroupSummary(prompt_id=s.prompt_id, round=s.round, policy_version=s.policy_version, n=s.n, k=s.k,
                           reward_mean=s.reward_mean, reward_std=s.reward_std, lengths=s.lengths,
                           mean_logprobs=s.mean_logprobs, bundle_digest=s.bundle_digest)


def summaries_from_pb(request: pb.PublishRequest) -> list[SummaryRow]:
    return [SummaryRow(node_id=request.node_id, round=s.round, prompt_id=s.prompt_id,
                       policy_version=s.policy_version, n=s.n, k=s.k, reward_mean=s.reward_mean,
                       reward_std=s.reward_std, lengths=list(s.lengths), mean_logprobs=list(s.mean_logprobs),
                       bundle_digest=s.bundle_digest)
            for s in request.summaries]


def match_result_to_pb(res: MatchResult) -> pb.MatchResponse:
    return pb.MatchResponse(
        ready=res.ready,
        offers=[pb.MatchOffer(prompt_id=o.prompt_id, source_node_id=o.source_node, source_model_id=o.source_model,
                              source_round=o.source_round, source_k=o.k, source_n=o.n, bundle_digest=o.digest)
                for o in res.offers],
        upload_requests=[pb.UploadRequest(prompt_id=p, round=r) for p, r in res.upload_requests],
        candidates=res.candidates, solved_by_peers=res.solved_by_peers)


def match_result_from_pb(resp: pb.MatchResponse) -> MatchResult:
    return MatchResult(
        ready=resp.ready,
        offers=[Offer(prompt_id=o.prompt_id, source_node=o.source_node_id, source_model=o.source_model_id,
                      source_round=o.source_round, k=o.source_k, n=o.source_n, digest=o.bundle_digest)
                for o in resp.offers],
        upload_requests=[(u.prompt_id, u.round) for u in resp.upload_requests],
        candidates=resp.candidates, solved_by_peers=resp.solved_by_peers)


def report_entries_to_pb(entries: Sequence[ReportEntry]) -> list[pb.CompatibilityReport.Entry]:
    return [pb.CompatibilityReport.Entry(source_node_id=e.source, prompt_id=e.prompt_id, mean_s=e.mean_s,
                                         admitted_fraction=e.admitted_fraction, rejected=e.rejected)
            for e in entries]


def report_entries_from_pb(request: pb.CompatibilityReport) -> list[ReportEntry]:
    return [ReportEntry(e.source_node_id, e.prompt_id, e.mean_s, e.admitted_fraction, e.rejected)
            for e in request.entries]
