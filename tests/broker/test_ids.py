"""Ids that end up in logs and on an operator's terminal are printable and one line."""

import pytest

from graft_fed.broker.sessions import check_id
from graft_fed.federation.errors import InvalidArgument


@pytest.mark.parametrize("bad", ["a\nb", "a\x1b[31mb", "a\x85b", "a\u2028b", "a\u2029b", "a\u200eb", "", "x" * 257])
def test_ids_that_could_forge_or_garble_a_log_line_are_refused(bad):
    with pytest.raises(InvalidArgument, match="node_id must be 1-256 printable characters"):
        check_id(bad, "node_id")


def test_printable_ids_from_any_script_are_taken():
    for good in ("alice", "inst-7_node.3", "café", "节点一", "a b"):
        check_id(good, "node_id")
