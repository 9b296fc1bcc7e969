"""Recipe loading: YAML defaults chains, Hydra-style overrides, pydantic section validation.

`load_config(path, overrides)` merges a recipe's `defaults:` chain (parents first, the child
wins; a cycle is a `ConfigError` of kind `defaults`) on unresolved trees, applies Hydra-grammar
overrides (kind `override`; with a `schema`, a key the pydantic models declare can be set even if
no YAML states it), then refuses any remaining `???` (kind `missing_value`, naming every key) and
resolves interpolations (kind `interpolation`) into a plain `dict`. `validate_section` returns the
validated model or ONE `ConfigError` of kind `section` listing every problem, each with its fix (a
model's rules across sections report through `cross_section_problems`; keys a model says are set
elsewhere, `SET_ELSEWHERE`, are named with where). Sweeps
and `@package` overrides are refused; assigning under a scalar never silently replaces it. Every
error is a `ConfigError` (a `ValueError`); its `kind` (`ConfigKind`) says which step failed.
The rules in full: docs/guides/token-capture.md, "Recipes: defaults chains and overrides".
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError
from yaml import YAMLError

from nemo_rl.data.errors import FatalError, Kinded

DEFAULTS_KEY = "defaults"
MISSING_MARK = "???"

ModelT = TypeVar("ModelT", bound=BaseModel)


ConfigKind = Literal["defaults", "override", "missing_value", "interpolation", "section"]
"""What is wrong: the `defaults:` chain (a missing parent, a cycle, a malformed entry, an
unreadable file); a command-line override that cannot be parsed or applied; mandatory (`???`)
values never set (or a value a run needs left null); a `${...}` interpolation that cannot be
resolved; a config section that failed its pydantic model (one line per problem)."""


class ConfigError(Kinded, FatalError, ValueError):
    """A recipe, an override or a config section is invalid; the message says how to fix it."""

    KINDS = typing.get_args(ConfigKind)
    kind: ConfigKind

    def __init__(self, message: str, *, kind: ConfigKind) -> None:
        super().__init__(message, kind=kind)


# ---------------------------------------------------------------------------------------------
# Defaults chain


def _read_yaml(path: Path, referenced_by: Path | None) -> DictConfig:
    if not path.is_file():
        where = f" (listed in `defaults:` of {referenced_by})" if referenced_by else ""
        raise ConfigError(
            f"config file {path} does not exist{where}; fix the path (parents are resolved "
            f"relative to the directory of the file that names them)",
            kind="defaults",
        )
    try:
        loaded = OmegaConf.load(path)
    except (YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"cannot parse YAML file {path}: {e}", kind="defaults") from e
    if not isinstance(loaded, DictConfig):
        raise ConfigError(
            f"config file {path} must hold a mapping at top level, got a {type(loaded).__name__}",
            kind="defaults",
        )
    return loaded


def _parent_paths(cfg: DictConfig, path: Path) -> list[Path]:
    """The parent files named by `cfg`'s `defaults:` key, resolved against `path`'s directory."""
    if DEFAULTS_KEY not in cfg.keys():
        return []
    raw = _node_value(cfg._get_node(DEFAULTS_KEY))
    entries = [raw] if isinstance(raw, str) else raw
    if not isinstance(entries, list) or not all(isinstance(x, str) and x for x in entries):
        raise ConfigError(
            f"{path}: `defaults:` must be a relative path or a list of relative paths, "
            f"got {raw!r}; fix: e.g. `defaults: ../base.yaml`",
            kind="defaults",
        )
    return [(path.parent / entry).resolve() for entry in entries]


def _load_chain(path: Path, stack: tuple[Path, ...], referenced_by: Path | None) -> DictConfig:
    if path in stack:
        chain = " -> ".join(str(p) for p in (*stack, path))
        raise ConfigError(f"cycle in `defaults:` chain: {chain}; remove one of these links", kind="defaults")
    own = _read_yaml(path, referenced_by)
    parents = _parent_paths(own, path)
    if DEFAULTS_KEY in own.keys():
        del own[DEFAULTS_KEY]
    merged = OmegaConf.create({})
    for parent in parents:
        merged = _merge(merged, _load_chain(parent, (*stack, path), path), parent)
    return _merge(merged, own, path)


def _merge(base: DictConfig, top: DictConfig, top_path: Path) -> DictConfig:
    """Merge unresolved trees (`???` and `${...}` are carried, never evaluated)."""
    try:
        merged = OmegaConf.merge(base, top)
    except OmegaConfBaseException as e:
        clashes = ", ".join(_kind_clashes(base, top, "")) or "<unknown>"
        raise ConfigError(
            f"cannot merge {top_path} over the config before it: {_first_line(e)} (at {clashes}); "
            f"fix: give that key the same kind of value (mapping or list) in both files",
            kind="defaults",
        ) from e
    assert isinstance(merged, DictConfig)
    return merged


def _first_line(e: OmegaConfBaseException) -> str:
    """OmegaConf appends `full_key:`/`object_type=` lines to its messages; we name keys ourselves."""
    return str(e).splitlines()[0]


def _kind_clashes(base: Any, top: Any, prefix: str) -> Iterator[str]:
    """Paths where one tree holds a mapping and the other a list (OmegaConf cannot merge them)."""
    if isinstance(base, DictConfig) and isinstance(top, DictConfig):
        if _is_container(base) and _is_container(top):
            for key in top.keys():
                if key in base.keys():
                    path = f"{prefix}.{key}" if prefix else str(key)
                    yield from _kind_clashes(base._get_node(key), top._get_node(key), path)
    elif {type(base), type(top)} == {DictConfig, ListConfig}:
        if _is_container(base) and _is_container(top):
            yield prefix or "<root>"


# ---------------------------------------------------------------------------------------------
# Tree walking that never resolves interpolations or touches `???`


def _is_container(node: Any) -> bool:
    return isinstance(node, (DictConfig, ListConfig)) and not node._is_missing() and not (
        node._is_none() or node._is_interpolation()
    )


def _child_keys(node: DictConfig | ListConfig) -> list[Any]:
    return list(node.keys()) if isinstance(node, DictConfig) else list(range(len(node)))


def _walk(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """Yield (dotted path, node) for every node below `node`, depth first."""
    if not _is_container(node):
        return
    for key in _child_keys(node):
        child = node._get_node(key)
        path = f"{prefix}.{key}" if prefix else str(key)
        yield path, child
        yield from _walk(child, path)


def find_missing_keys(cfg: DictConfig) -> list[str]:
    """Dotted paths of every `???` value in `cfg`, in document order."""
    return [path for path, node in _walk(cfg, "") if node._is_missing()]


def _lookup(container: Any, part: str) -> tuple[bool, Any]:
    """(exists, child node) for one path component, without resolving anything."""
    if not _is_container(container):
        return False, None
    if isinstance(container, ListConfig):
        if not part.isdigit() or int(part) >= len(container):
            return False, None
        return True, container._get_node(int(part))
    if part not in container.keys():
        return False, None
    return True, container._get_node(part)


def _key_exists(cfg: DictConfig, key: str) -> bool:
    node: Any = cfg
    for part in key.split("."):
        exists, node = _lookup(node, part)
        if not exists:
            return False
    return True


def _close_keys(cfg: DictConfig, key: str) -> str:
    paths = [path for path, _ in _walk(cfg, "")]
    close = difflib.get_close_matches(key, paths, n=5, cutoff=0.6)
    if close:
        return "close existing keys: " + ", ".join(close)
    parent_path, _, _ = key.rpartition(".")
    if parent_path and _key_exists(cfg, parent_path):
        _, parent = _lookup_path(cfg, parent_path)
        if _is_container(parent):
            return f"keys under {parent_path}: " + ", ".join(str(k) for k in _child_keys(parent))
    return "top-level keys: " + ", ".join(str(k) for k in cfg.keys())


def _lookup_path(cfg: DictConfig, key: str) -> tuple[Any, Any]:
    """(parent container, node) of an existing dotted key."""
    parent: Any = None
    node: Any = cfg
    for part in key.split("."):
        parent = node
        _, node = _lookup(node, part)
    return parent, node


# ---------------------------------------------------------------------------------------------
# Overrides


def parse_overrides(overrides: Sequence[str]) -> list[Override]:
    """Parse Hydra-style override strings; reject sweeps, packages and empty keys."""
    parser = OverridesParser.create()
    parsed: list[Override] = []
    for text in overrides:
        try:
            override = parser.parse_override(text)
        except HydraException as e:
            raise ConfigError(
                f"cannot parse override {text!r}: {e}; fix: use key=value, +key=value, "
                f"++key=value or ~key (quote values with spaces or special characters)",
                kind="override",
            ) from e
        if not override.key_or_group:
            raise ConfigError(f"override {text!r} has an empty key; fix: use key=value", kind="override")
        if override.package is not None:
            raise ConfigError(
                f"override {text!r} uses @package, which recipes do not support; "
                f"fix: write the full dotted key",
                kind="override",
            )
        if override.is_sweep_override():
            raise ConfigError(
                f"override {text!r} is a sweep; a recipe run takes one value per key; "
                f"fix: quote the value if the comma is literal, e.g. key='a,b'",
                kind="override",
            )
        parsed.append(override)
    return parsed


def _node_value(node: Any) -> Any:
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=False)
    return node._value()


def _ensure_parent(cfg: DictConfig, key: str, text: str) -> tuple[Any, str | int]:
    """Walk to the parent of `key`, creating missing mappings (add modes only)."""
    parts = key.split(".")
    node: Any = cfg
    walked: list[str] = []
    for part in parts[:-1]:
        walked.append(part)
        exists, child = _lookup(node, part)
        if not exists:
            if isinstance(node, ListConfig):
                raise ConfigError(
                    f"override {text!r}: {'.'.join(walked)} is not an index of the list at "
                    f"{'.'.join(walked[:-1])} (length {len(node)}); fix: use an index in range",
                    kind="override",
                )
            node[part] = {}
            child = node._get_node(part)
        elif child._is_missing() or child._is_none():
            # `???` and null are placeholders, so filling them with a mapping loses nothing.
            node[part] = {}
            child = node._get_node(part)
        elif not _is_container(child):
            raise ConfigError(
                f"override {text!r}: {'.'.join(walked)} holds the value "
                f"{_node_value(child)!r}, not a mapping, so {key} cannot be set under it; "
                f"fix: replace it whole, e.g. ++{'.'.join(walked)}={{...}}",
                kind="override",
            )
        node = child
    last = parts[-1]
    if isinstance(node, ListConfig):
        if not last.isdigit():
            raise ConfigError(
                f"override {text!r}: {'.'.join(parts[:-1])} is a list, so {last!r} must be an "
                f"index; fix: use {'.'.join(parts[:-1])}.<index>",
                kind="override",
            )
        return node, int(last)
    return node, last


def _assign(cfg: DictConfig, key: str, value: Any, text: str) -> None:
    parent, last = _ensure_parent(cfg, key, text)
    if isinstance(parent, ListConfig) and not 0 <= int(last) < len(parent):
        raise ConfigError(
            f"override {text!r}: index {last} is out of range for the list at "
            f"{key.rpartition('.')[0]} (length {len(parent)}); fix: use an index in range",
            kind="override",
        )
    exists, current = _lookup(parent, str(last))
    if exists and isinstance(value, dict) and isinstance(current, DictConfig) and _is_container(
        current
    ):
        parent[last] = OmegaConf.merge(current, value)
    else:
        parent[last] = value


def schema_declares(schema: type[BaseModel] | None, key: str) -> bool:
    """Whether the dotted `key` names a field of `schema` (through nested pydantic models)."""
    current = schema
    for part in key.split("."):
        if current is None or part not in current.model_fields:
            return False
        current = _model_in(current.model_fields[part].annotation)
    return True


def apply_override(cfg: DictConfig, override: Override, schema: type[BaseModel] | None = None) -> None:
    """Apply one parsed override to `cfg` in place (see the module contract for semantics)."""
    key = override.key_or_group
    text = override.input_line
    value = override.value()
    exists = _key_exists(cfg, key)
    if override.is_delete():
        if not exists:
            raise ConfigError(
                f"cannot delete {key} ({text!r}): key does not exist; {_close_keys(cfg, key)}",
                kind="override",
            )
        parent, node = _lookup_path(cfg, key)
        if value is not None and _node_value(node) != value:
            raise ConfigError(
                f"cannot delete {key} ({text!r}): its value is {_node_value(node)!r}, "
                f"not {value!r}; fix: use ~{key} to delete unconditionally",
                kind="override",
            )
        last = key.rpartition(".")[2]
        if isinstance(parent, ListConfig):
            parent.pop(int(last))
        else:
            del parent[last]
    elif override.is_add():
        if exists:
            raise ConfigError(
                f"cannot add {key} ({text!r}): key already exists; fix: use {key}=... to "
                f"change it or ++{key}=... to add-or-change",
                kind="override",
            )
        _assign(cfg, key, value, text)
    elif override.is_force_add():
        _assign(cfg, key, value, text)
    else:
        if not exists and not schema_declares(schema, key):
            raise ConfigError(
                f"cannot override {key} ({text!r}): key does not exist; "
                f"{_close_keys(cfg, key)}; fix: correct the key, or use +{key}=... to add it",
                kind="override",
            )
        _assign(cfg, key, value, text)


def _missing_message(paths: list[str]) -> str:
    return "\n".join(
        f"{p} is mandatory ({MISSING_MARK}) and was not set: add {p}=<value> on the command "
        f"line or in the recipe"
        for p in paths
    )


def load_config(path: str | Path, overrides: Sequence[str] = (), schema: type[BaseModel] | None = None) -> dict:
    """Load a recipe with its defaults chain, apply overrides, check `???`, resolve `${...}`."""
    root = Path(path).resolve()
    cfg = _load_chain(root, (), None)
    for override in parse_overrides(list(overrides)):
        apply_override(cfg, override, schema)
    missing = find_missing_keys(cfg)
    if missing:
        raise ConfigError(_missing_message(missing), kind="missing_value")
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ConfigError(
            f"cannot resolve {e.full_key}: {_first_line(e)}; fix: point the interpolation at an "
            f"existing key or set {e.full_key} directly",
            kind="interpolation",
        ) from e
    assert isinstance(resolved, dict)
    return resolved


# ---------------------------------------------------------------------------------------------
# Section validation


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model class inside an annotation (Optional[M], list[M], dict[str, M], M)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is None:
        return None
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _model_at(model_cls: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class that owns the mapping located at `loc` (None when it is not a model)."""
    current: type[BaseModel] | None = model_cls
    for part in loc:
        if current is None:
            return None
        if isinstance(part, str) and part in current.model_fields:
            current = _model_in(current.model_fields[part].annotation)
        # int indices and dict keys step into the element model already chosen by _model_in
    return current


def _dotted(section: str, loc: tuple[Any, ...]) -> str:
    parts = [section] if section else []
    return ".".join([*parts, *(str(p) for p in loc)])


def _annotation_name(model_cls: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    owner = _model_at(model_cls, loc[:-1])
    if owner is None or not loc or loc[-1] not in owner.model_fields:
        return None
    annotation = owner.model_fields[loc[-1]].annotation
    if isinstance(annotation, type) and typing.get_origin(annotation) is None:
        return annotation.__name__
    return str(annotation).replace("typing.", "")


_BOUND_WORDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _fix_for(error: dict, path: str, model_cls: type[BaseModel], loc: tuple[Any, ...]) -> str:
    kind = error["type"]
    ctx = error.get("ctx", {})
    if "fix" in ctx:  # a model's own fix for its custom error, naming the field by `{path}`
        return str(ctx["fix"]).format(path=path)
    for bound, word in _BOUND_WORDS.items():
        if bound in ctx:
            limit = ctx[bound]
            shown = int(limit) if isinstance(limit, float) and limit.is_integer() else limit
            return f"set {path} to a value {word} {shown}"
    if kind == "missing":
        return f"add {path}=<value>"
    if kind == "string_pattern_mismatch":
        return f"set {path} to a string matching {ctx['pattern']}"
    if kind == "string_too_short":
        return f"set {path} to a string of at least {ctx['min_length']} character(s)"
    if kind == "finite_number":
        return f"set {path} to a finite number"
    type_name = _annotation_name(model_cls, loc)
    if type_name is not None:
        return f"set {path} to a value of type {type_name}"
    return f"change {path}"


def _format_error(error: dict, section: str, model_cls: type[BaseModel]) -> str:
    loc = tuple(error["loc"])
    path = _dotted(section, loc)
    if error["type"] == CROSS_SECTION_ERROR:
        return error["msg"]  # names every key it involves and its fix
    if error["type"] == "extra_forbidden":
        owner = _model_at(model_cls, loc[:-1])
        elsewhere = getattr(owner, SET_ELSEWHERE, {}).get(loc[-1]) if owner is not None else None
        if elsewhere is not None:
            return f"{path}={error['input']!r}: {elsewhere}"
        allowed = ", ".join(owner.model_fields) if owner is not None else "(unknown)"
        return (
            f"{path}={error['input']!r}: unknown key {path}; allowed keys: {allowed} "
            f"(fix: remove {path} or rename it to an allowed key)"
        )
    shown = "<unset>" if error["type"] == "missing" else repr(error["input"])
    return f"{path}={shown}: {error['msg']} (fix: {_fix_for(error, path, model_cls, loc)})"


CROSS_SECTION_ERROR = "cross_section"
# A model's ClassVar naming keys a recipe sets elsewhere: key -> why and the fix.
SET_ELSEWHERE = "SET_ELSEWHERE"


def cross_section_problems(title: str, problems: Sequence[tuple[tuple[str, ...], str]]) -> ValidationError:
    """What a model validator raises for rules across sections: one error per `(loc, message)`, each
    message naming every key it involves and its fix; `validate_section` lists them as they are."""
    return ValidationError.from_exception_data(title, [
        InitErrorDetails(type=PydanticCustomError(CROSS_SECTION_ERROR, "{problem}", {"problem": message}),
                         loc=loc, input=None)
        for loc, message in problems
    ])


def validate_section(model_cls: type[ModelT], data: dict, section: str) -> ModelT:
    """Validate `data` (the recipe's `section` mapping; "" for the whole recipe) against `model_cls`."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"{section}={data!r}: expected a mapping for section {section} "
            f"(fix: make {section} a mapping of keys to values)",
            kind="section",
        )
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        lines = [_format_error(err, section, model_cls) for err in e.errors()]
        raise ConfigError(
            f"{f'invalid config section {section}' if section else 'invalid recipe'} ({len(lines)} problem(s)):\n"
            + "\n".join(lines),
            kind="section",
        ) from e
