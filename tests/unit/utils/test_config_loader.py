"""load_config: defaults chains, `???` handling, Hydra-style overrides, interpolation."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rl.utils.config import ConfigError, load_config


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def chain(tmp_path: Path) -> Path:
    """grandparent (base/) <- parent (recipes/) <- child (recipes/runs/), each a different dir."""
    write(
        tmp_path / "base" / "grpo_base.yaml",
        "policy:\n"
        "  model_dir: ???\n"
        "  lr: 1.0e-05\n"
        "grpo:\n"
        "  max_num_steps: 100\n"
        "  num_generations: 8\n"
        "token_capture:\n"
        "  enabled: false\n"
        "logger:\n"
        "  log_dir: logs/steps_${grpo.max_num_steps}\n"
        "  model: ${policy.model_dir}\n"
        "tags: [a, b]\n",
    )
    write(
        tmp_path / "recipes" / "grpo_arith.yaml",
        "defaults: ../base/grpo_base.yaml\n"
        "grpo:\n"
        "  max_num_steps: 20\n"
        "  group: arith\n",
    )
    return write(
        tmp_path / "recipes" / "runs" / "tiny.yaml",
        "defaults:\n"
        "  - ../grpo_arith.yaml\n"
        "policy:\n"
        "  model_dir: models/tiny\n"
        "grpo:\n"
        "  num_generations: 4\n",
    )


def test_depth_three_chain_child_fills_grandparent_mandatory(chain: Path) -> None:
    cfg = load_config(chain)
    assert cfg == {
        "policy": {"model_dir": "models/tiny", "lr": 1.0e-05},
        "grpo": {"max_num_steps": 20, "num_generations": 4, "group": "arith"},
        "token_capture": {"enabled": False},
        "logger": {"log_dir": "logs/steps_20", "model": "models/tiny"},
        "tags": ["a", "b"],
    }


def test_accepts_str_path_and_later_listed_parent_wins(tmp_path: Path) -> None:
    write(tmp_path / "one.yaml", "x: 1\ny: 1\nz: 1\n")
    write(tmp_path / "two.yaml", "y: 2\nz: 2\n")
    child = write(tmp_path / "c.yaml", "defaults: [one.yaml, two.yaml]\nz: 3\n")
    assert load_config(str(child)) == {"x": 1, "y": 2, "z": 3}


def test_diamond_is_not_a_cycle(tmp_path: Path) -> None:
    write(tmp_path / "root.yaml", "r: 0\n")
    write(tmp_path / "left.yaml", "defaults: root.yaml\nl: 1\n")
    write(tmp_path / "right.yaml", "defaults: root.yaml\nr: 2\n")
    child = write(tmp_path / "c.yaml", "defaults: [left.yaml, right.yaml]\n")
    assert load_config(child) == {"r": 2, "l": 1}


def test_unset_mandatory_value_names_the_path(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", "policy:\n  model_dir: ???\nrun:\n  seeds:\n    - 1\n    - ???\n")
    child = write(tmp_path / "c.yaml", "defaults: base.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(child)
    assert e.value.kind == "missing_value"
    assert str(e.value) == (
        "policy.model_dir is mandatory (???) and was not set: add policy.model_dir=<value> "
        "on the command line or in the recipe\n"
        "run.seeds.1 is mandatory (???) and was not set: add run.seeds.1=<value> "
        "on the command line or in the recipe"
    )


def test_child_mandatory_marker_does_not_erase_parent_value(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", "a: 5\n")
    child = write(tmp_path / "c.yaml", "defaults: base.yaml\na: ???\n")
    assert load_config(child) == {"a": 5}


def test_mandatory_value_filled_by_override(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", "policy:\n  model_dir: ???\n  name: ${policy.model_dir}\n")
    child = write(tmp_path / "c.yaml", "defaults: base.yaml\n")
    cfg = load_config(child, ["policy.model_dir=/m/x"])
    assert cfg == {"policy": {"model_dir": "/m/x", "name": "/m/x"}}


def test_override_kinds(chain: Path) -> None:
    cfg = load_config(
        chain,
        [
            "token_capture.enabled=true",
            "grpo.max_num_steps=3",
            "+new.key=v",
            "++grpo.num_generations=16",
            "++grpo.fresh=1.5",
            "~tags",
            "policy.lr=null",
            "grpo.group='42'",
            "+extra.list=[1,two,null]",
        ],
    )
    assert cfg["token_capture"]["enabled"] is True
    assert cfg["grpo"] == {
        "max_num_steps": 3,
        "num_generations": 16,
        "group": "42",
        "fresh": 1.5,
    }
    assert cfg["new"] == {"key": "v"}
    assert "tags" not in cfg
    assert cfg["policy"]["lr"] is None
    assert cfg["extra"] == {"list": [1, "two", None]}
    # interpolation resolves after overrides
    assert cfg["logger"]["log_dir"] == "logs/steps_3"


def test_dict_value_merges_into_existing_mapping(chain: Path) -> None:
    cfg = load_config(chain, ["grpo={max_num_steps: 7}"])
    assert cfg["grpo"] == {"max_num_steps": 7, "num_generations": 4, "group": "arith"}


def test_override_list_index(chain: Path) -> None:
    assert load_config(chain, ["tags.1=z"])["tags"] == ["a", "z"]
    assert load_config(chain, ["~tags.0"])["tags"] == ["b"]


def test_force_add_fills_null_placeholder(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "lora: null\n")
    assert load_config(path, ["++lora.rank=8"]) == {"lora": {"rank": 8}}


def test_unknown_key_override_names_it_and_close_keys(chain: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(chain, ["grpo.max_num_step=3"])
    assert e.value.kind == "override"
    assert str(e.value) == (
        "cannot override grpo.max_num_step ('grpo.max_num_step=3'): key does not exist; "
        "close existing keys: grpo.max_num_steps; "
        "fix: correct the key, or use +grpo.max_num_step=... to add it"
    )


def test_unknown_key_without_close_match_lists_siblings(chain: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(chain, ["grpo.zzzzzzzz=1"])
    assert e.value.kind == "override"
    assert "keys under grpo: max_num_steps, num_generations, group;" in str(e.value)


def test_add_existing_key_is_an_error(chain: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(chain, ["+grpo.max_num_steps=1"])
    assert e.value.kind == "override"
    assert str(e.value) == (
        "cannot add grpo.max_num_steps ('+grpo.max_num_steps=1'): key already exists; "
        "fix: use grpo.max_num_steps=... to change it or ++grpo.max_num_steps=... to "
        "add-or-change"
    )


def test_delete_missing_key_and_conditional_delete(chain: Path) -> None:
    with pytest.raises(ConfigError, match=r"^cannot delete grpo\.nope \('~grpo\.nope'\)") as raised:
        load_config(chain, ["~grpo.nope"])
    assert raised.value.kind == "override"
    with pytest.raises(ConfigError) as e:
        load_config(chain, ["~grpo.max_num_steps=5"])
    assert e.value.kind == "override"
    assert str(e.value) == (
        "cannot delete grpo.max_num_steps ('~grpo.max_num_steps=5'): its value is 20, not 5; "
        "fix: use ~grpo.max_num_steps to delete unconditionally"
    )
    assert "group" not in load_config(chain, ["~grpo.group=arith"])["grpo"]


def test_setting_under_a_scalar_is_an_error_not_a_clobber(chain: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(chain, ["++grpo.max_num_steps.x=1"])
    assert e.value.kind == "override"
    assert str(e.value) == (
        "override '++grpo.max_num_steps.x=1': grpo.max_num_steps holds the value 20, not a "
        "mapping, so grpo.max_num_steps.x cannot be set under it; fix: replace it whole, "
        "e.g. ++grpo.max_num_steps={...}"
    )


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("grpo.max_num_steps=1,2", "is a sweep"),
        ("grpo.max_num_steps=choice(1,2)", "is a sweep"),
        ("grpo.max_num_steps@pkg=1", "uses @package"),
        ("a b=1", "cannot parse override 'a b=1'"),
        ("=1", "has an empty key"),
        ("+tags.5=x", "index 5 is out of range for the list at tags (length 2)"),
        ("+tags.x=1", "tags is a list, so 'x' must be an index"),
    ],
)
def test_malformed_overrides(chain: Path, override: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(chain, [override])
    assert e.value.kind == "override"
    assert fragment in str(e.value)


def test_defaults_cycle_names_the_chain(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yaml", "defaults: sub/b.yaml\nx: 1\n")
    b = write(tmp_path / "sub" / "b.yaml", "defaults: ../a.yaml\ny: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(a)
    assert e.value.kind == "defaults"
    assert str(e.value) == (
        f"cycle in `defaults:` chain: {a.resolve()} -> {b.resolve()} -> {a.resolve()}; "
        f"remove one of these links"
    )


def test_self_cycle(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yaml", "defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle in `defaults:` chain") as raised:
        load_config(a)
    assert raised.value.kind == "defaults"


def test_missing_parent_names_parent_and_child(tmp_path: Path) -> None:
    child = write(tmp_path / "runs" / "c.yaml", "defaults: ../nope.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(child)
    assert e.value.kind == "defaults"
    assert str(e.value) == (
        f"config file {(tmp_path / 'nope.yaml').resolve()} does not exist (listed in "
        f"`defaults:` of {child.resolve()}); fix the path (parents are resolved relative to "
        f"the directory of the file that names them)"
    )


def test_missing_root_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file .*absent\.yaml does not exist; fix") as raised:
        load_config(tmp_path / "absent.yaml")
    assert raised.value.kind == "defaults"


@pytest.mark.parametrize("defaults", ["[1, 2]", "{a: b}", "''"])
def test_malformed_defaults_entry(tmp_path: Path, defaults: str) -> None:
    path = write(tmp_path / "c.yaml", f"defaults: {defaults}\n")
    with pytest.raises(ConfigError, match="`defaults:` must be a relative path or a list") as raised:
        load_config(path)
    assert raised.value.kind == "defaults"


def test_non_mapping_yaml_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must hold a mapping at top level, got a ListConfig") as raised:
        load_config(write(tmp_path / "l.yaml", "- 1\n- 2\n"))
    assert raised.value.kind == "defaults"
    with pytest.raises(ConfigError, match="cannot parse YAML file") as raised:
        load_config(write(tmp_path / "bad.yaml", "a: [1, 2\n"))
    assert raised.value.kind == "defaults"


def test_mapping_list_clash_names_the_key(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", "outer:\n  l: [1, 2]\n")
    child = write(tmp_path / "c.yaml", "defaults: base.yaml\nouter:\n  l: {x: 1}\n")
    with pytest.raises(ConfigError) as e:
        load_config(child)
    assert e.value.kind == "defaults"
    assert str(e.value).startswith(f"cannot merge {child.resolve()} over the config before it: ")
    assert str(e.value).endswith(
        "(at outer.l); fix: give that key the same kind of value (mapping or list) in both files"
    )


def test_unresolvable_interpolation_names_the_key(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "a:\n  b: ${nowhere.x}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.kind == "interpolation"
    assert str(e.value) == (
        "cannot resolve a.b: Interpolation key 'nowhere.x' not found; fix: point the "
        "interpolation at an existing key or set a.b directly"
    )


def test_interpolation_into_grandparent_mandatory_resolves_only_at_end(tmp_path: Path) -> None:
    write(tmp_path / "g.yaml", "dir: ???\nout: ${dir}/out\n")
    write(tmp_path / "p.yaml", "defaults: g.yaml\nlog: ${out}/log\n")
    child = write(tmp_path / "c.yaml", "defaults: p.yaml\ndir: /r\n")
    assert load_config(child) == {"dir": "/r", "out": "/r/out", "log": "/r/out/log"}


_keys = st.text(alphabet="abcdefgh", min_size=1, max_size=3)
_scalars = st.one_of(
    st.integers(-1000, 1000), st.booleans(), st.text(alphabet="xyz ", min_size=1, max_size=5)
)
_trees = st.recursive(
    _scalars, lambda inner: st.dictionaries(_keys, inner, min_size=1, max_size=3), max_leaves=8
)


def _merged(parent: dict, child: dict) -> dict:
    out = dict(parent)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


@settings(max_examples=40, deadline=None)
@given(
    parent=st.dictionaries(_keys, _trees, max_size=4),
    child=st.dictionaries(_keys, _trees, max_size=4),
)
def test_child_wins_recursively(parent: dict, child: dict) -> None:
    with tempfile.TemporaryDirectory() as d:
        write(Path(d) / "p.yaml", yaml.safe_dump(parent))
        child_path = write(Path(d) / "c.yaml", yaml.safe_dump({"defaults": "p.yaml", **child}))
        assert load_config(child_path) == _merged(parent, child)


@settings(max_examples=40, deadline=None)
@given(value=st.one_of(st.integers(), st.booleans(), st.none()))
def test_scalar_override_round_trips(value: object) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = write(Path(d) / "c.yaml", "k: 0\n")
        text = "null" if value is None else str(value).lower()
        assert load_config(path, [f"k={text}"]) == {"k": value}


def test_a_key_the_schema_declares_is_set_without_plus(tmp_path: Path) -> None:
    from pydantic import BaseModel

    class Env(BaseModel):
        agent: str = "simple_agent"
        max_steps: int = 4

    class Schema(BaseModel):
        env: Env

    path = write(tmp_path / "c.yaml", "env:\n  max_steps: 2\n")
    assert load_config(path, ["env.agent=compacting_agent"], schema=Schema) == {
        "env": {"max_steps": 2, "agent": "compacting_agent"}
    }
    # A typo is still refused with the same message as without a schema.
    with pytest.raises(ConfigError, match=r"cannot override env.agnet .*key does not exist") as raised:
        load_config(path, ["env.agnet=x"], schema=Schema)
    assert raised.value.kind == "override"


def test_a_dict_section_declared_by_a_model_takes_its_keys_without_plus() -> None:
    from nemo_rl.algorithms.grpo_config import load_master_config

    recipe = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_capture_tiny_cpu.yaml"
    cfg = load_master_config(recipe, ["policy.lr_warmup_steps=5", "env.arith_problem_pool=16"])
    assert (cfg.policy.lr_warmup_steps, cfg.env.arith_problem_pool) == (5, 16)
    with pytest.raises(ConfigError, match=r"cannot override policy.lr_warmpu_steps .*key does not exist") as raised:
        load_master_config(recipe, ["policy.lr_warmpu_steps=5"])
    assert raised.value.kind == "override"
