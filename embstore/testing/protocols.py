"""Check a class against a :class:`typing.Protocol`: every member present, every method's
signature compatible (what a caller may pass the protocol's method, it may pass this one)."""

from __future__ import annotations

import inspect
from typing import Any

from ..engine.protocols import protocol_members

__all__ = ["conformance_problems", "signature_problems"]

_P = inspect.Parameter


def signature_problems(declared: inspect.Signature, actual: inspect.Signature) -> list[str]:
    """Ways a call valid for ``declared`` could fail on ``actual`` (``self`` excluded)."""
    dp = [p for p in declared.parameters.values()]
    ap = [p for p in actual.parameters.values()]
    a_by_name = {p.name: p for p in ap}
    a_var_kw = any(p.kind is _P.VAR_KEYWORD for p in ap)
    a_var_pos = any(p.kind is _P.VAR_POSITIONAL for p in ap)
    a_pos = [p for p in ap if p.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)]
    problems = []
    d_pos = [p for p in dp if p.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)]
    for i, p in enumerate(d_pos):
        if i >= len(a_pos):
            if not a_var_pos:
                problems.append(f"missing positional parameter {p.name!r}")
            continue
        q = a_pos[i]
        if q.name != p.name and p.kind is _P.POSITIONAL_OR_KEYWORD:
            problems.append(f"positional parameter {i} is {q.name!r}, declared {p.name!r}")
        if p.default is not _P.empty and q.default is _P.empty:
            problems.append(f"{p.name!r} has no default")
    for p in dp:
        if p.kind is _P.KEYWORD_ONLY:
            kw = a_by_name.get(p.name)
            if kw is None:
                if not a_var_kw:
                    problems.append(f"missing keyword parameter {p.name!r}")
            elif kw.kind not in (_P.KEYWORD_ONLY, _P.POSITIONAL_OR_KEYWORD):
                problems.append(f"{p.name!r} cannot be passed by keyword")
            elif p.default is not _P.empty and kw.default is _P.empty:
                problems.append(f"{p.name!r} has no default")
        elif p.kind is _P.VAR_POSITIONAL and not a_var_pos:
            problems.append(f"does not take *{p.name}")
        elif p.kind is _P.VAR_KEYWORD and not a_var_kw:
            problems.append(f"does not take **{p.name}")
    declared_names = {p.name for p in dp}
    for q in ap:
        extra = q.name not in declared_names and q.kind in (_P.POSITIONAL_OR_KEYWORD,
                                                              _P.KEYWORD_ONLY, _P.POSITIONAL_ONLY)
        if extra and q.default is _P.empty:
            problems.append(f"extra parameter {q.name!r} without a default")
    return problems


def _unbound(sig: inspect.Signature) -> inspect.Signature:
    params = list(sig.parameters.values())
    return sig.replace(parameters=params[1:]) if params and params[0].name == "self" else sig


def conformance_problems(protocol: type, obj: Any) -> list[str]:
    """Every way ``obj`` (an instance or a class) falls short of ``protocol``.

    Methods are looked up on the class and their signatures compared; data members and
    properties must be reachable without running any code (``inspect.getattr_static``) or,
    on a class, declared by an annotation.
    """
    cls = obj if isinstance(obj, type) else type(obj)
    annotated = {n for k in cls.__mro__ for n in k.__dict__.get("__annotations__", {})}
    problems = []
    for name, declared in protocol_members(protocol).items():
        try:
            found = inspect.getattr_static(obj, name)
        except AttributeError:
            if declared is None and isinstance(obj, type) and name in annotated:
                continue
            if isinstance(declared, property) and isinstance(obj, type) and name in annotated:
                continue
            problems.append(f"{cls.__name__}.{name}: missing")
            continue
        if not inspect.isfunction(declared):
            continue
        impl = inspect.getattr_static(cls, name, None)
        if isinstance(impl, (staticmethod, classmethod)) or not callable(impl):
            problems.append(f"{cls.__name__}.{name}: not a method ({type(found).__name__})")
            continue
        for problem in signature_problems(_unbound(inspect.signature(declared)),
                                          _unbound(inspect.signature(impl))):
            problems.append(f"{cls.__name__}.{name}: {problem}")
    return problems
