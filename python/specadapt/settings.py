"""Settings records and their command-line flags: one definition per setting, shared by every front end.

A technique's settings are a frozen dataclass (``TTSConfig``, ``AVConfig``, ``EstimatorConfig``) whose fields
carry their default, validation and, in :func:`setting` metadata, the flag a front end shows for them (name,
help, choices, which front ends expose it). The front ends (``specadapt generate`` / ``serve`` and the SGLang
plugin) add their flags with :func:`add_arguments`, build the record back with :func:`from_namespace` and turn a
:class:`SettingError` (which names the *field*) into a message naming the *flag* with :func:`flag_message`.

Technique-free and front-end-free: only the standard library.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Callable

__all__ = ["FRONT_ENDS", "Flag", "SettingError", "add_arguments", "check_choices", "dataclass_fields_for",
           "flag_message", "flags_of", "from_namespace", "nested", "require", "setting"]

#: The front ends: the embedded engine's CLI (``generate`` / ``serve``) and the SGLang plugin's flags.
FRONT_ENDS = ("engine", "sglang")


class SettingError(ValueError):
    """A setting out of range. ``str()`` names the field (``"stride must be >= 1, got 0"``); a front end
    rewords it with its flag names (:func:`flag_message`).

    Args:
        name: the field at fault.
        detail: the rest of the message; ``{other}`` marks another field's name (listed in ``related``).
        related: fields named inside ``detail``.
    """

    def __init__(self, name: str, detail: str, related: tuple[str, ...] = ()) -> None:
        self.name, self.detail, self.related = name, detail, tuple(related)
        super().__init__(self.render(lambda n: n))

    def render(self, name_of: Callable[[str], str]) -> str:
        """The message with every field name passed through ``name_of`` (e.g. field -> flag)."""
        detail = self.detail
        for other in self.related:
            detail = detail.replace("{" + other + "}", name_of(other))
        return f"{name_of(self.name)} {detail}"


def require(ok: bool, name: str, detail: str, *related: str) -> None:
    """Raise :class:`SettingError` ``(name, detail, related)`` unless ``ok``."""
    if not ok:
        raise SettingError(name, detail, related)


def setting(default: Any = MISSING, *, flag: str | None = None, help: str | dict[str, str] = "",
            choices: tuple | None = None, fronts: tuple[str, ...] = FRONT_ENDS, negate: bool = False,
            metavar: str | None = None, type: Callable | None = None):
    """A dataclass field with its flag.

    Args:
        default: the one default of the setting.
        flag: ``--name`` of the flag, or ``None`` (a setting no front end exposes).
        help: help text, or ``{front end: text}`` where the meaning differs per front end.
        choices: allowed values (also checked by :func:`check_choices`).
        fronts: the front ends exposing the flag (:data:`FRONT_ENDS` by default).
        negate: a ``store_true`` flag that turns a default-``True`` setting off (``--av-no-early-stop``).
        metavar, type: as argparse's; ``type`` defaults to the default's type.
    """
    meta = dict(flag=flag, help=help, choices=choices, fronts=tuple(fronts), negate=negate, metavar=metavar, type=type)
    return field(default=default, metadata={"setting": meta})


def nested(cls):
    """A field holding another settings record (its flags are listed with the outer record's)."""
    return field(default_factory=cls, metadata={"nested": True})


@dataclass(frozen=True)
class Flag:
    """One flag of a settings record: ``path`` of field names (nested records first), its ``--flag``, the argparse
    ``dest`` (the flag without dashes; also the SGLang plugin's setting name), default and help."""

    path: tuple[str, ...]
    flag: str
    default: Any
    help: str
    choices: tuple | None
    negate: bool
    metavar: str | None
    type: Callable | None

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _walk(cls, prefix: tuple[str, ...] = ()):
    for f in fields(cls):
        if f.metadata.get("nested"):
            yield from _walk(f.default_factory, prefix + (f.name,))
        else:
            yield prefix + (f.name,), f


def flags_of(cls, front: str | None = None) -> list[Flag]:
    """The flags of settings record ``cls`` (nested records included) exposed by ``front`` (``None``: by any),
    in field order."""
    out = []
    for path, f in _walk(cls):
        meta = f.metadata.get("setting")
        if not meta or not meta["flag"] or (front is not None and front not in meta["fronts"]):
            continue
        text = meta["help"]
        if isinstance(text, dict):
            text = text.get(front) or next(iter(text.values()))
        out.append(Flag(path, meta["flag"], f.default, text, meta["choices"], meta["negate"], meta["metavar"],
                        meta["type"]))
    return out


def add_arguments(parser, cls, front: str, explicit_only: bool = False) -> None:
    """Add the flags of ``cls`` that ``front`` exposes to ``parser`` (a parser or an argument group).

    ``explicit_only``: every default is ``None`` (so explicit flags can be told from defaults when merged over
    another source, as the SGLang plugin does); the help then states the record's default.
    """
    for f in flags_of(cls, front):
        kwargs: dict[str, Any] = {"dest": f.dest, "help": f.help}
        if isinstance(f.default, bool):
            kwargs.update(action="store_true", default=None if explicit_only else False)
        else:
            kwargs.update(default=None if explicit_only else f.default, choices=f.choices, metavar=f.metavar)
            kind = f.type or (type(f.default) if f.default is not None else str)
            kwargs["type"] = kind
            if explicit_only and f.default is not None:
                kwargs["help"] = f"{f.help} (default {f.default})"
        parser.add_argument(f.flag, **kwargs)


def from_namespace(cls, source, front: str):
    """Build ``cls`` from the attributes of ``source`` (an argparse namespace, or any object with the flags'
    ``dest`` names) for the flags ``front`` exposes; a missing or ``None`` attribute keeps the default.

    Raises:
        SettingError: a value out of range (it names the field; see :func:`flag_message`).
    """
    values: dict[tuple[str, ...], Any] = {}
    for f in flags_of(cls, front):
        value = getattr(source, f.dest, None)
        if value is not None:
            values[f.path] = (not value) if f.negate else value
    return _build(cls, values, ())


def _build(cls, values: dict, prefix: tuple[str, ...]):
    kwargs = {}
    for f in fields(cls):
        path = prefix + (f.name,)
        if f.metadata.get("nested"):
            inner = {p: v for p, v in values.items() if p[: len(path)] == path}
            if inner:
                kwargs[f.name] = _build(f.default_factory, inner, path)
        elif path in values:
            kwargs[f.name] = values[path]
    return cls(**kwargs)


def flag_message(exc: Exception, cls, front: str) -> str:
    """``exc``'s message with the field names of ``cls`` replaced by ``front``'s flag names (fields without a
    flag there keep their name); a plain exception's message is returned as it is."""
    if not isinstance(exc, SettingError):
        return str(exc)
    flags = {f.name: f.flag for f in flags_of(cls, front)}
    return exc.render(lambda name: flags.get(name, name))


def check_choices(record) -> None:
    """Raise :class:`SettingError` for a field of ``record`` (a settings dataclass) outside its ``choices``."""
    assert is_dataclass(record)
    for f in fields(record):
        meta = f.metadata.get("setting")
        value = getattr(record, f.name)
        if meta and meta["choices"] and value not in meta["choices"]:
            allowed = " or ".join(map(str, meta["choices"])) if len(meta["choices"]) == 2 else \
                f"one of {', '.join(map(str, meta['choices']))}"
            raise SettingError(f.name, f"must be {allowed}, got {value!r}")


def dataclass_fields_for(cls, front: str) -> list[tuple[str, Any, Any]]:
    """``(dest, type, field)`` triples of ``cls``'s flags for ``front``, for :func:`dataclasses.make_dataclass`:
    a flat record whose field names are the flags' ``dest`` and whose defaults are ``cls``'s (the SGLang plugin's
    ``PluginConfig``)."""
    out = []
    for f in flags_of(cls, front):
        default = (not f.default) if f.negate else f.default
        out.append((f.dest, Any, field(default=default)))
    return out
