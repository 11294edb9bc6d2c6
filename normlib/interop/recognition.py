"""Recognition by code: which kind (or which norm left alone) a class's forward computes.

A class counts as a kind when its ``forward`` is the same code as the forward
of one of the kind's anchor classes (see :mod:`normlib.interop`): the same
syntax tree once annotations, docstrings, comments, formatting and local names
are set aside, the same objects behind its global names, the same code behind
the methods it calls on ``self`` and behind its ``super()`` calls. Anchors of
other libraries are read from their source files without importing them.
:func:`recognise` then looks at a module's settings (the kind's ``select``),
and :class:`Verdict` is what a swap acts on.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import os
import re
import sys
import textwrap
import threading
from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional, Union

from torch import nn

from ..errors import NormTypeError
from .kinds import KINDS, UNFUSED, Anchor, Binding, NormKind, Unfused

__all__ = ["recognise", "classify", "Verdict"]

# ---- what a method computes: its normalised code, the globals it reads, the methods it calls -------


def _locals(fn_tree: ast.AST) -> set:
    """Names local to a function: its arguments and every name it binds (not those declared global)."""
    names, outer = set(), set()
    for node in ast.walk(fn_tree):
        if isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            outer.update(node.names)
    return names - outer


class _Normalise(ast.NodeTransformer):
    """Drops annotations, decorators and docstrings (any bare string statement), and renames locals in order."""

    def __init__(self, local_names: set):
        self.local_names: set = local_names
        self.renamed: dict[str, str] = {}

    def _rename(self, name: str) -> str:
        if name not in self.local_names:
            return name
        return self.renamed.setdefault(name, f"_v{len(self.renamed)}")

    def visit_FunctionDef(self, node):
        node.decorator_list, node.returns, node.type_comment = [], None, None
        node.name = "f"
        self.generic_visit(node)
        node.body = node.body or [ast.Pass()]
        return node

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_arg(self, node):
        node.annotation, node.type_comment = None, None
        node.arg = self._rename(node.arg)
        return node

    def visit_Name(self, node):
        node.id = self._rename(node.id)
        return node

    def visit_AnnAssign(self, node):
        if node.value is None:  # a bare annotation computes nothing
            return None
        return self.visit(ast.Assign(targets=[node.target], value=node.value, lineno=0))

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return None  # a docstring, or any string statement: no effect
        return self.generic_visit(node)


_FunctionNode = Union[ast.FunctionDef, ast.AsyncFunctionDef]


def _parse(src: str) -> Optional[_FunctionNode]:
    try:
        tree = ast.parse(textwrap.dedent(src)).body[0]
    except (SyntaxError, IndexError):
        return None
    return tree if isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _normalised(tree: _FunctionNode) -> tuple[_FunctionNode, set, Optional[str]]:
    """``(normalised tree, its global names, the renamed name of its first argument)``."""
    local_names = _locals(tree)
    globals_ = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - local_names
    first = tree.args.args[0].arg if tree.args.args else None
    norm = _Normalise(local_names)
    tree = norm.visit(tree)
    return tree, globals_, norm.renamed.get(first) if first is not None else None


def _dump(tree: ast.AST) -> str:
    return ast.dump(tree, annotate_fields=False, include_attributes=False)


def _owner(cls: type, name: str, after: Optional[type] = None) -> Optional[type]:
    """The class in ``cls.__mro__`` (after ``after``, if given) whose ``__dict__`` defines ``name``."""
    mro = cls.__mro__
    if after is not None:
        mro = mro[mro.index(after) + 1:] if after in mro else ()
    return next((c for c in mro if name in c.__dict__), None)


def _is_self_call(node: ast.AST, self_name: Optional[str]) -> Optional[str]:
    """``name`` for a call ``self.name(...)``."""
    if self_name is not None and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        v = node.func.value
        if isinstance(v, ast.Name) and v.id == self_name:
            return node.func.attr
    return None


def _self_attribute(node: ast.AST, self_name: Optional[str]) -> Optional[str]:
    """``name`` for a read of ``self.name``."""
    if self_name is not None and isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        if isinstance(node.value, ast.Name) and node.value.id == self_name:
            return node.attr
    return None


def _is_super_attr(node: ast.AST) -> Optional[str]:
    """``name`` for ``super().name``."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call):
        f = node.value.func
        if isinstance(f, ast.Name) and f.id == "super" and not node.value.args:
            return node.attr
    return None


def _is_method(cls: type, name: str) -> bool:
    attr = inspect.getattr_static(cls, name, None)
    return inspect.isfunction(attr) or isinstance(attr, (staticmethod, classmethod))


_MISSING = object()
# Classifying a class fills several caches and marks a method being read (None in _SIGS) while it recurses:
# one thread at a time (reentrant, for the recursion), so that no thread reads another's half-made answer.
_LOCK = threading.RLock()
_SIGS: dict = {}  # (cls, method name) -> signature, or None where it cannot be told
_READS: dict = {}  # (cls, method name) -> the attributes of self it reads (through the methods it calls, too)


def _signature(cls: type, name: str, depth: int = 0):
    """A value equal for two classes exactly when their method ``name`` computes the same thing.

    Built from the method's normalised syntax tree, the identity of every global
    it reads, the signatures of the methods it calls on ``self`` and the
    identity of what its ``super().…`` calls resolve to. ``None`` when it cannot
    be told (no source, too deep).
    """
    key = (cls, name)
    with _LOCK:  # never read outside it: while one thread recurses, its entry is a placeholder None
        if key in _SIGS:
            return _SIGS[key]
        return _read_signature(cls, name, depth, key)


def _read_signature(cls: type, name: str, depth: int, key: tuple):
    """:func:`_signature`'s work, under ``_LOCK``."""
    _SIGS[key] = None  # guards against recursion
    owner = _owner(cls, name)
    fn = owner.__dict__.get(name) if owner is not None else None
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    if not inspect.isfunction(fn) or depth > 3:
        return None
    if set(fn.__code__.co_freevars) - {"__class__"}:  # a closure: only the very same function is the same
        _SIGS[key], _READS[key] = ("function", id(fn)), set()
        return _SIGS[key]
    try:
        tree = _parse(inspect.getsource(fn))
    except (OSError, TypeError):
        tree = None
    if tree is None:
        return None
    tree, global_names, self_name = _normalised(tree)
    globals_ = {n: id(fn.__globals__.get(n, getattr(builtins, n, _MISSING))) for n in global_names}
    calls, supers, reads = {}, {}, set()
    for node in ast.walk(tree):
        called = _is_self_call(node, self_name)
        if called is not None and called not in calls and _is_method(cls, called):
            sig = _signature(cls, called, depth + 1)
            if sig is None:
                return None
            calls[called] = sig
            reads |= _READS.get((cls, called), set())
        attr = _self_attribute(node, self_name)
        if attr is not None and not _is_method(cls, attr):
            reads.add(attr)
        via_super = _is_super_attr(node)
        if via_super is not None:
            parent = _owner(cls, via_super, after=owner)
            supers[via_super] = id(parent.__dict__[via_super]) if parent is not None else None
    sig = (_dump(tree), tuple(sorted(globals_.items())), tuple(sorted(calls.items())), tuple(sorted(supers.items())))
    _SIGS[key], _READS[key] = sig, reads
    return sig


def _reads(cls: type) -> set:
    """The attributes of ``self`` that ``cls``'s forward reads (empty where its computation cannot be told)."""
    _signature(cls, "forward")
    return _READS.get((cls, "forward"), set())


def _forward_dump(cls: type) -> Optional[str]:
    """The normalised syntax tree of ``cls``'s forward alone (cheap: no globals, no methods)."""
    sig = _signature(cls, "forward")
    return sig[0] if isinstance(sig, tuple) and sig and sig[0] != "function" else None


# ---- anchors: found in their files first, imported only when a class has their syntax tree ----------

_STATIC: dict = {}  # (module, class) -> the normalised dump of its forward read from the file, or None


def _library_loaded(mod: str) -> bool:
    return mod in sys.modules or mod.partition(".")[0] in sys.modules


def _anchor_file(module: str) -> Optional[str]:
    """The source file of ``module`` (dotted), found from its top-level package's folder: nothing is imported."""
    top, _, rest = module.partition(".")
    pkg = sys.modules.get(top)
    if pkg is not None:
        folders = list(getattr(pkg, "__path__", None) or [])
    else:
        spec = importlib.util.find_spec(top)  # a top-level name: finding it imports nothing
        if spec is None:
            return None
        folders = list(spec.submodule_search_locations or [])
    parts = rest.split(".") if rest else []
    for folder in folders:
        base = os.path.join(folder, *parts)
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                return path
    return None


def _static_dump(anchor: Anchor) -> Optional[str]:
    """The anchor's forward, parsed from its source file without importing it; ``None`` if not found there."""
    key = (anchor.module, anchor.name)
    if key in _STATIC:
        return _STATIC[key]
    _STATIC[key] = None
    try:
        path = _anchor_file(anchor.module)
        if path is None:  # not installed, or a module without a source file
            return None
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (ImportError, ValueError, AttributeError, TypeError, OSError, UnicodeDecodeError):
        return None
    found = re.search(rf"^class {re.escape(anchor.name)}\b.*?:[ \t]*$", text, re.M)
    if found is None:
        return None
    rest = text[found.end():]
    end = re.search(r"^\S", rest, re.M)  # the next statement at the top level ends the class
    body = rest[: end.start()] if end else rest
    fwd = re.search(r"^([ \t]+)def forward\(", body, re.M)
    if fwd is None:  # inherited: only importing tells
        return None
    lines, out = body[fwd.start():].splitlines(), []
    indent = len(fwd.group(1))
    for i, line in enumerate(lines):
        stripped = line.strip()
        if i and stripped and not stripped.startswith("#") and len(line) - len(line.lstrip()) <= indent:
            break
        out.append(line)
    tree = _parse("\n".join(out))
    if tree is not None:
        _STATIC[key] = _dump(_normalised(tree)[0])
    return _STATIC[key]


def _anchor_class(anchor: Anchor, dump: Optional[str]) -> Optional[type]:
    """The anchor class, if its forward could equal one whose syntax tree is ``dump``; ``None`` if it cannot.

    A model of one family (say Qwen2) imports its own modeling file only, and a
    user's copy of a class imports none: the anchor's file (Llama's) is read
    without importing anything, and imported only once a class with the
    anchor's syntax tree turns up. Where that file does not hold the forward
    (inherited), the anchor is imported only if its library is in use already.
    """
    if anchor.module in sys.modules:
        return getattr(sys.modules[anchor.module], anchor.name, None)
    static = _static_dump(anchor)
    if static is None and not _library_loaded(anchor.module):
        return None
    if static is not None and static != dump:
        return None
    try:
        module = importlib.import_module(anchor.module)
    except Exception:  # another version of the library, without that file, or one that fails to import
        return None
    cls = getattr(module, anchor.name, None)
    return cls if isinstance(cls, type) else None


def _same_computation(cls: type, anchor: type) -> bool:
    if cls is anchor:
        return True
    sig = _signature(cls, "forward")
    return sig is not None and sig == _signature(anchor, "forward")


_TORCH_FUSED = (nn.LayerNorm, nn.RMSNorm)
_TORCH_NORMS = _TORCH_FUSED + UNFUSED["torch_norm_without_kernel"].torch_classes
_UNKNOWN = ("its forward computes none of the norms normlib fuses (normlib.interop.KINDS); it runs unchanged "
            "(if it is a standard norm, please report it)")
_CLASSES: dict = {}  # (class, which anchor libraries were loaded) -> (kind or Unfused or None, anchor or None, why)


def _libraries() -> tuple:
    """Which anchors' libraries are imported: a class's match can only change when these do."""
    return tuple(_library_loaded(a.module) for table in (KINDS, UNFUSED) for e in table.values() for a in e.anchors)


# what recognition makes of a class or module: a kind to swap to, a norm left alone with its reason, none of
# the norms normlib knows, or a normlib module already
_Status = Literal["swap", "left", "unknown", "normlib"]


class _Match(NamedTuple):
    """What a class's forward computes: a kind (``entry`` a NormKind), a norm left alone (an Unfused entry, or a
    torch norm's subclass with a forward of its own: ``status`` "left"), none of them ("unknown"), or a normlib
    class ("normlib"); with the anchor it matched and the reason the report gives."""

    entry: Union[NormKind, Unfused, None]
    anchor: Optional[Anchor]
    status: _Status
    why: str


def _match(cls: type) -> _Match:
    """What ``cls``'s forward computes (:class:`_Match`), from its forward alone; cached per class."""
    key = (cls, _libraries())
    if key in _CLASSES:
        return _CLASSES[key]
    with _LOCK:
        if key not in _CLASSES:
            _CLASSES[key] = _classify_class(cls)
    return _CLASSES[key]


def _classify_class(cls: type) -> _Match:
    """:func:`_match`'s work, under ``_LOCK``."""
    if cls.__module__.startswith("normlib."):
        return _Match(None, None, "normlib", "already a normlib module")
    if cls.__module__.startswith("torch.") and not issubclass(cls, _TORCH_NORMS):
        return _Match(None, None, "unknown", _UNKNOWN)  # torch's own Linear, Dropout, ...: known not to be norms
    return _match_forward(cls)


def _match_forward(cls: type) -> _Match:
    dump = _forward_dump(cls)
    for table in (KINDS, UNFUSED):
        for entry in table.values():
            for anchor in entry.anchors:
                anchor_cls = _anchor_class(anchor, dump)
                if isinstance(anchor_cls, type) and _same_computation(cls, anchor_cls):
                    if isinstance(entry, Unfused):
                        return _Match(entry, anchor, "left", entry.reason)
                    return _Match(entry, anchor, "swap", _anchor_why(cls, anchor_cls))
    for entry in UNFUSED.values():
        if entry.torch_classes and issubclass(cls, entry.torch_classes):
            return _Match(entry, None, "left", entry.reason)
    for tc in _TORCH_FUSED:
        if issubclass(cls, tc):
            return _Match(None, None, "left", f"subclass of torch.nn.{tc.__name__} with a forward of its own, which "
                                              "normlib does not know; it runs unchanged")
    return _Match(None, None, "unknown", _UNKNOWN)


def _anchor_why(cls: type, anchor_cls: type) -> str:
    name = f"{anchor_cls.__module__}.{anchor_cls.__qualname__}"
    if anchor_cls.__module__.startswith("torch.") and issubclass(cls, anchor_cls):
        return name + ("" if cls is anchor_cls else " subclass")
    return f"forward identical to {name}"


def classify(cls: type) -> tuple[Optional[str], str]:
    """``(kind, why)`` for a norm class from its forward alone: a name of ``KINDS``, or ``None`` and the reason.

    Instances may still be left alone by their settings (``recognise`` looks
    at those): a ConvNeXt LayerNorm is ``channels_first_layer_norm`` here and
    ``layer_norm`` with ``data_format="channels_last"``. Norms deliberately
    left alone (``UNFUSED``) give their reason.

    Example:
        >>> classify(nn.LayerNorm)
        ('layer_norm', 'torch.nn.modules.normalization.LayerNorm')
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise NormTypeError(f"cls must be a torch.nn.Module subclass (got {cls!r})")
    m = _match(cls)
    return (m.entry.name, m.why) if isinstance(m.entry, NormKind) else (None, m.why)


@dataclass(frozen=True)
class Verdict:
    """What normlib makes of one module: the binding a swapped forward reads, or why it is left alone.

    ``status`` says which: ``"swap"`` (a kind, ``binding`` set), ``"left"``
    (normlib knows what the class computes, or that a setting or the module
    itself keeps it from the kernels: the report lists it with ``reason``),
    ``"unknown"`` (a forward that computes none of the kinds: listed only if it
    looks like a norm) or ``"normlib"`` (a normlib module already).
    """

    status: _Status
    reason: str
    binding: Optional[Binding] = None

    @staticmethod
    def left(reason: str) -> "Verdict":
        return Verdict("left", reason)


def _verdict(module: nn.Module) -> Verdict:
    """What a swap makes of ``module``: see :class:`Verdict`."""
    cls = type(module)
    entry, anchor, status, why = _match(cls)
    if status != "swap":
        return Verdict(status, why)
    assert isinstance(entry, NormKind) and anchor is not None  # what _match returns with "swap"
    missing = {a for a in _reads(cls) if not hasattr(module, a)}
    b = Binding(entry.name, anchor.weight, anchor.bias, anchor.eps)
    if entry.select is not None and not missing - {anchor.weight}:
        selected, why_not = entry.select(module, b, _reads(cls))
        if selected is None:
            return Verdict.left(why_not)
        b = selected
    missing -= {t for t in (anchor.weight, anchor.bias) if t is not None and t not in (b.weight, b.bias)}
    if missing:  # a γ the settings switch off (Gemma-3n's with_scale=False) need not exist
        return Verdict.left(f"{why}, but it has no attribute {', '.join(sorted(missing))}; it runs unchanged")
    return Verdict("swap", why, b)


def recognise(module: nn.Module) -> tuple[Optional[NormKind], str]:
    """``(kind, why)`` for a module; ``kind`` is ``None`` when normlib leaves it alone, and ``why`` says why.

    Example:
        >>> recognise(nn.LayerNorm(4))[0].name
        'layer_norm'
    """
    if not isinstance(module, nn.Module):
        raise NormTypeError(f"module must be a torch.nn.Module (got {type(module).__name__})")
    v = _verdict(module)
    return (KINDS[v.binding.kind] if v.binding is not None else None), v.reason
