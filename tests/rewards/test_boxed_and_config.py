import pytest

from graft_fed.configbase import from_mapping
from graft_fed.errors import ConfigError
from graft_fed.rewards import VerifierConfig, last_boxed


@pytest.mark.parametrize("text, expected", [
    ("the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
    ("$\\fbox{7}$", "7"),
    ("\\boxed {x+1}", "x+1"),
    ("\\boxed 5$", "5"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("no box here", None),
    ("\\boxed{3} and at the end \\boxed{\\frac{1}{2", None),
    ("\\boxedx{3}", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("kwargs, fragment", [
    ({"name": ""}, "plugin"),
    ({"name": "no_colon"}, "package.module:function"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": float("inf")}, "timeout_s"),
    ({"workers": 0}, "workers"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"start_method": "fork"}, "unsafe"),
    ({"exact_match_fast_path": "yes"}, "true or false"),
])
def test_config_rejects_bad_values(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        VerifierConfig(**kwargs)


def test_config_loads_from_mapping_and_refuses_unknown_keys():
    cfg = from_mapping(VerifierConfig, {"timeout_s": 2, "name": "tests.rewards.verifier_plugins:exact"})
    assert cfg.timeout_s == 2.0 and cfg.name.endswith(":exact")
    with pytest.raises(ConfigError, match="did you mean 'timeout_s'"):
        from_mapping(VerifierConfig, {"timeout": 2})
