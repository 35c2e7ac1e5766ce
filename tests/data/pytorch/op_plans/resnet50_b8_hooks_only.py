"""The op-plan runtime with nothing to recompute (made from resnet50_b8_525.py with
RECOMPUTE emptied): times what the hooks and the dispatch mode cost by themselves
(docs/benchmarks/data/step_time_op_cases.json). Not a plan.
"""

RECOMPUTE = [
]

# ---- memplan's runtime for op plans (src/remat/pytorch_rerun.py) --------------------
#
# How a value of RECOMPUTE is found: module forward hooks keep the stack of module calls
# (each module's calls counted, as the TorchScript exporter's scopes `relu`, `relu_1`,
# `relu_2` name them), and a TorchDispatchMode sees every aten op of the forward. The
# k-th aten op of the entry's kind and output size run directly inside the entry's
# module call computes it (sizes are compared, not shapes: an op of the same kind and
# size in the same call can stand in for another where the two graphs count ops
# differently; the values are still right, only what is dropped differs).
#
# For each such op a recipe is kept: the op and its arguments (a recomputed argument as
# its recipe, a view of one as that view). The saved-tensor hooks then pack the recipe
# instead of the tensor, so nothing but the recipe refers to the tensor after forward
# and it is freed. Backward's first unpack runs the recipe (nested recipes first) and
# the result is kept until the last backward node that saved it has unpacked it; a
# saved view of a recomputed value is that view of the result.
#
# The values are bitwise the same as forward's:
# - an in-place op reruns out of place (or on a copy), unless its input was just
#   computed by a nested recipe that nothing else holds; its recipe reads its input as
#   it was before the op, and a tensor a recipe reads that forward changes in place
#   later is copied first (the plan keeps that value);
# - BatchNorm in training mode reruns as one pass from forward's batch statistics (the
#   mean and inverse deviation its backward keeps anyway): addcmul(beta, x, alpha), the
#   fused multiply-add the CPU kernel computes. That it gives the op's output to the
#   bit is checked once per process and kind of input (op, device, dtypes, shape,
#   strides), on forward's output and on a run with random weight and bias; where it
#   does not, and in eval mode, BatchNorm reruns the same aten op, its running
#   statistics copied where the op would update them;
# - dropout reapplies the mask (CPU: the noise) forward drew, kept or, where the plan
#   drops it too, drawn again from the random state forward drew it from.
# A tensor modified in place between forward and backward is an error, as in PyTorch
# without hooks. These hooks take precedence over saved-tensor hooks set around the
# model call (`save_on_cpu`, an outer checkpoint) inside the model's forward.

import collections
import contextlib
import re
import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakTensorKeyDictionary

# ONNX op type -> the aten ops (overload packet names; in-place ones end with "_") that
# compute it in eager PyTorch.
_ATEN = {
    "Add": ("add", "add_"),
    "AveragePool": ("avg_pool2d", "avg_pool1d", "avg_pool3d"),
    "BatchNormalization": ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
                           "cudnn_batch_norm", "miopen_batch_norm", "_batch_norm_with_update"),
    "Conv": ("convolution",),
    "Div": ("div", "div_"),
    "Dropout": ("native_dropout",),
    "Elu": ("elu", "elu_"),
    "Erf": ("erf", "erf_"),
    "Gather": ("embedding",),
    "Gelu": ("gelu", "gelu_"),
    "HardSigmoid": ("hardsigmoid", "hardsigmoid_"),
    "HardSwish": ("hardswish", "hardswish_"),
    "LayerNormalization": ("native_layer_norm",),
    "LeakyRelu": ("leaky_relu", "leaky_relu_"),
    "MaxPool": ("max_pool2d_with_indices", "max_pool3d_with_indices", "max_pool1d_with_indices"),
    "Mul": ("mul", "mul_"),
    "Neg": ("neg", "neg_"),
    "Pow": ("pow", "pow_"),
    "Relu": ("relu", "relu_"),
    "Sigmoid": ("sigmoid", "sigmoid_"),
    "Softmax": ("_softmax",),
    "Sqrt": ("sqrt", "sqrt_"),
    "Sub": ("sub", "sub_"),
    "Tanh": ("tanh", "tanh_"),
}
_KIND = {a: k for k, names in _ATEN.items() for a in names}
# BatchNorm's aten ops (CPU, CUDA with and without cuDNN, ROCm). A rerun calls the same
# op with copies of the running statistics where it would update them: in training mode
# the output reads only the batch statistics, in eval mode the same running ones.
_BATCH_NORM = ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
               "cudnn_batch_norm", "miopen_batch_norm", "_batch_norm_with_update")
# In-place ops whose out-of-place op has the same overload (relu_.default -> relu.default);
# any other in-place op reruns on a copy of its input.
_SAME_OVERLOAD = ("add_", "sub_", "mul_", "div_", "relu_", "sigmoid_", "tanh_", "hardswish_",
                  "hardsigmoid_", "leaky_relu_", "elu_", "gelu_", "neg_", "sqrt_", "erf_")
# Further outputs of these kinds, dropped with the first where the plan drops the node's
# other outputs too (an entry's `rest`): MaxPool's indices, BatchNorm's batch mean and
# inverse deviation, dropout's mask (drawn again from the random state forward used).
_ALSO = {"MaxPool": (1,), "BatchNormalization": (1, 2), "Dropout": (1,)}


class _Held:
    """A tensor saved as it is, or one a recipe reads, as it was then. `version`: its
    version counter then (None: not checked, a BatchNorm's running statistics).
    PyTorch checks that a saved tensor was not modified in place only where no
    saved-tensor hooks are set, so these hooks check it here."""

    __slots__ = ("value", "version", "__weakref__")

    def __init__(self, value, version=None):
        self.value, self.version = value, version

    def get(self):
        if self.version is not None and self.value._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                "operation (memplan's saved-tensor hooks: version %d, expected %d)" % (self.value._version, self.version))
        return self.value


class _View:
    """A view of a recomputed value (a reshape before a matrix product), saved or read
    by a recipe: the same view of the value computed again."""

    __slots__ = ("recipe", "size", "stride", "offset", "base")

    def __init__(self, recipe, t):
        self.recipe, self.size, self.stride, self.offset = recipe, t.size(), t.stride(), t.storage_offset()
        self.base = (t._base.size(), t._base.stride(), t._base.storage_offset())

    def of(self, v):
        if (v.size(), v.stride(), v.storage_offset()) != self.base:
            raise RuntimeError("memplan: a recomputed value came out with another layout than forward's, "
                               "so a view of it cannot be taken again")
        return v.as_strided(self.size, self.stride, self.offset)


class _Recipe:
    """A value dropped after forward and computed again when backward unpacks it."""

    __slots__ = ("func", "args", "kwargs", "index", "pending", "cache", "siblings", "rng", "stats", "__weakref__")

    def __init__(self, func, args, kwargs, index, siblings, rng=None, stats=None):
        self.func, self.args, self.kwargs, self.index = func, args, kwargs, index
        self.pending, self.cache, self.siblings, self.rng = 0, None, siblings, rng
        # a training-mode BatchNorm's output: forward's batch mean and inverse deviation
        self.stats = stats

    def run(self):
        """(value, fresh): fresh when nothing else holds the value (ours to change)."""
        if self.cache is not None:
            return self.cache, False
        fresh = []

        def value(a):
            if isinstance(a, _Recipe):
                v, new = a.run()
                fresh.append(new)
                return v
            if isinstance(a, _View):
                fresh.append(False)
                return a.of(a.recipe.run()[0])
            if isinstance(a, _Held):
                fresh.append(False)
                return a.get()
            return a

        args = tree_map(value, self.args)
        kwargs = tree_map(value, self.kwargs)
        name = self.func.overloadpacket.__name__
        if self.rng is not None:
            # a random op: drawn again from the state forward drew it from
            with _random_state(self.rng):
                out = self.func(*args, **kwargs)
        elif name == "native_dropout":
            # the mask forward drew, as the CPU kernel applies it (never drawn again)
            x, mask, p = args
            out = x.mul(mask).mul_(0.0 if p == 1 else 1.0 / (1.0 - p))
        elif self.stats is not None:
            out = _normalize(args[0], args[1], args[2], *(h.get() for h in self.stats))
        elif name in _BATCH_NORM:
            out = self.func(*_batch_norm_args(self.func, args), **kwargs)
        elif name.endswith("_") and not (fresh and fresh[0]):
            # an in-place op on a value that is not ours to change
            if name in _SAME_OVERLOAD:
                out = getattr(getattr(torch.ops.aten, name[:-1]), self.func._overloadname)(*args, **kwargs)
            else:
                out = self.func(args[0].clone(), *args[1:], **kwargs)
        else:
            out = self.func(*args, **kwargs)
        if isinstance(out, (tuple, list)):
            for ref in self.siblings:  # the other outputs, kept for the nodes that saved them
                r = ref()
                if r is not None and r is not self and r.pending > 0 and r.cache is None:
                    r.cache = out[r.index]
            out = out[self.index]
        if self.pending > 0:
            # also saved by a backward node that has not run yet: kept for it
            self.cache = out
        return out, self.cache is None


def _batch_norm_training(func, args):
    """Whether this BatchNorm call normalises with the batch's own statistics."""
    return func.overloadpacket.__name__ == "_batch_norm_with_update" or (
        len(args) > 5 and args[3 if func._overloadname == "no_stats" else 5] is True)


def _batch_norm_args(func, args):
    """BatchNorm's arguments for a rerun: its running statistics copied where the op
    updates them (training mode), so that the rerun leaves them alone."""
    name, args = func.overloadpacket.__name__, list(args)
    if func._overloadname == "no_stats" or name == "_native_batch_norm_legit_functional":
        return args
    if _batch_norm_training(func, args):
        for i in (3, 4):
            if isinstance(args[i], torch.Tensor):
                args[i] = args[i].clone()
    return args


def _normalize(x, weight, bias, mean, invstd):
    """A training-mode BatchNorm's output from its batch statistics, as the CPU kernel
    computes it: alpha = invstd * weight, beta = fma(-mean, alpha, bias), out = fma(x,
    alpha, beta) (addcmul's kernel contracts its multiply and add into one fma)."""
    alpha = invstd if weight is None else invstd * weight
    beta = torch.addcmul(torch.zeros_like(mean) if bias is None else bias, -mean, alpha)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return torch.addcmul(beta.view(shape), x, alpha.view(shape))


# (op, device, dtypes, shape, strides, weight and bias given) -> whether _normalize
# gives the kernel's output to the bit
_NORMALIZE_EXACT = {}


def _normalize_exact(func, args, kwargs, out):
    """Whether _normalize reproduces this training-mode BatchNorm, dtype and strides
    included: compared with forward's own output, and with the op run again on the same
    input with random weight and bias (a fresh model's ones and zeros would hide a beta
    rounded another way), its running statistics copied and the global random state
    left alone. Any error counts as no. Costs up to three output-sized temporaries,
    once per kind of input and process."""
    x, weight, bias = args[0], args[1], args[2]

    def same(a, b):
        return a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)

    try:
        with torch.no_grad():
            if not same(_normalize(x, weight, bias, out[1], out[2]), out[0]):
                return False
            gen = torch.Generator().manual_seed(0)
            trial = list(args)
            for i, p in ((1, weight), (2, bias)):
                if isinstance(p, torch.Tensor):
                    r = torch.rand(p.shape, generator=gen, dtype=torch.float64) + 0.5 if i == 1 else \
                        torch.randn(p.shape, generator=gen, dtype=torch.float64)
                    trial[i] = r.to(dtype=p.dtype, device=p.device)
            o = func(*_batch_norm_args(func, trial), **kwargs)
            return same(_normalize(x, trial[1], trial[2], o[1], o[2]), o[0])
    except Exception:  # noqa: BLE001 (whatever fails, the aten op reruns instead)
        return False


def _batch_norm_stats(func, args, kwargs, out):
    """Forward's batch mean and inverse deviation, where a rerun may compute the output
    from them alone (_normalize): a training-mode BatchNorm whose output _normalize was
    found to reproduce bitwise for this kind of input; None otherwise."""
    x = args[0]
    if not _batch_norm_training(func, args) or not isinstance(out, (tuple, list)) or len(out) < 3 or x.dim() < 2:
        return None
    mean, invstd = out[1], out[2]
    if not all(isinstance(t, torch.Tensor) and t.shape == (x.shape[1],) for t in (mean, invstd)):
        return None
    w, b = args[1], args[2]
    key = (func, x.device, x.dtype, mean.dtype, None if w is None else w.dtype, tuple(x.shape), x.stride(),
           b is None)
    exact = _NORMALIZE_EXACT.get(key)
    if exact is None:
        exact = _NORMALIZE_EXACT[key] = _normalize_exact(func, args, kwargs, out)
    return (_Held(mean, mean._version), _Held(invstd, invstd._version)) if exact else None


def _rng_state(t):
    """The random state an op on `t`'s device draws from now."""
    if t.device.type == "cuda":
        return t.device, torch.cuda.get_rng_state(t.device)
    return t.device, torch.get_rng_state()


@contextlib.contextmanager
def _random_state(rng):
    device, state = rng
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda" if cuda else "cpu"):
        if cuda:
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        yield


class _Noise(_Recipe):
    """CPU dropout's noise: empty_like, bernoulli_ and div_, drawn again."""

    __slots__ = ("like", "p", "div")

    def __init__(self, like, rng, p):
        super().__init__(None, (), {}, 0, [], rng)
        self.like = (like.size(), like.stride(), like.dtype, like.device)
        self.p, self.div = p, None

    def run(self):
        if self.cache is not None:
            return self.cache, False
        size, stride, dtype, device = self.like
        with _random_state(self.rng):
            out = torch.empty_strided(size, stride, dtype=dtype, device=device).bernoulli_(self.p)
        if self.div is not None:
            out.div_(self.div)
        if self.pending > 0:
            self.cache = out
        return out, self.cache is None


class _Forward:
    """One forward pass: the module calls, the recipes, the tensors recipes hold."""

    def __init__(self, wanted):
        self.wanted = wanted
        self.frames = []
        self.calls = collections.Counter()
        self.recipes = WeakTensorKeyDictionary()
        self.held = WeakTensorKeyDictionary()
        self.found = set()
        self.noise = WeakTensorKeyDictionary()  # CPU dropout's noise tensors (bernoulli_)

    def capture(self, a, checked=True):
        """What a recipe keeps of argument `a`: its recipe, a view of one, or the tensor."""
        if not isinstance(a, torch.Tensor):
            return a
        r = self.recipes.get(a)
        if r is not None:
            return r
        if a._base is not None and self.recipes.get(a._base) is not None:
            return _View(self.recipes.get(a._base), a)
        h = _Held(a, a._version if checked else None)
        self.held.setdefault(a, []).append(weakref.ref(h))
        return h

    def before_mutation(self, t):
        """`t` is about to change in place: recipes holding it (or its base) get a copy."""
        for x in (t, t._base):
            if x is None:
                continue
            holders = [h for h in (r() for r in self.held.pop(x, ())) if h is not None]
            if holders:
                with torch.no_grad():
                    copy = x.detach().clone()
                for h in holders:
                    h.value = copy
                    if h.version is not None:
                        h.version = copy._version

    def changed(self, t):
        """`t` changed in place: the recipes of it and of its base no longer compute it."""
        for x in (t, t._base):
            if x is not None and x not in self.noise:
                self.recipes.pop(x, None)

    def pack(self, t):
        r = self.recipes.get(t)
        if r is not None:
            r.pending += 1
            return r
        if t._base is not None:
            r = self.recipes.get(t._base)
            if r is not None:
                r.pending += 1
                return _View(r, t)
        return _Held(t, t._version)


def _unpack(p):
    if isinstance(p, _Held):
        return p.get()
    view = None
    if isinstance(p, _View):
        view, p = p, p.recipe
    v, _ = p.run()
    p.pending -= 1
    p.cache = v if p.pending > 0 else None
    return v if view is None else view.of(v)


class _Mode(TorchDispatchMode):
    def __init__(self, fwd, stream=None):
        super().__init__()
        self.fwd = fwd
        self.stream = stream  # compile_policy: (kind, taken) of every op counted, in order
        self.kinds = _Kinds() if stream is not None else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        f = self.fwd
        name = func.overloadpacket.__name__
        kind = _KIND.get(name)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        # Dropout on CPU is empty_like, bernoulli_ of that noise, div_ of the noise, and a
        # mul of the input by it: that mul is the ONNX Dropout, the div_ no ONNX op.
        noise = [a for a in args[:2] if isinstance(a, torch.Tensor) and a in f.noise]
        if noise:
            kind = "Dropout" if name == "mul" else None
        rng = _rng_state(first) if name in ("bernoulli_", "native_dropout") and first is not None else None
        mutates = name.endswith("_") and first is not None

        def key_of(t, k=kind, advance=True):
            """(module call, kind, size, rank) of an op of kind `k` writing `t`."""
            frame, counts = f.frames[-1]
            size = t.numel() * t.element_size()
            key = (frame, k, size, counts[k, size])
            if advance:
                counts[k, size] += 1
            return key

        key = want = captured = None
        if mutates and kind is not None and f.frames:
            # an in-place op: its output is its first argument, and the recipe must read
            # that argument as it is now, before the op changes it
            key = key_of(first)
            want = f.wanted.get(key)
            if want is not None:
                captured = self.capture(func, args, kwargs, want)
        if mutates:
            f.before_mutation(first)
        out = func(*args, **kwargs)
        if name == "bernoulli_":
            f.noise[first] = _Noise(first, rng, args[1] if len(args) > 1 else kwargs.get("p", 0.5))
        elif name == "div_" and first in f.noise and f.frames:
            # the noise is complete; autograd packs it when the mul is recorded, before
            # that mul reaches this mode: drop it now if the plan drops that Dropout's mask
            f.noise[first].div = args[1]
            w = f.wanted.get(key_of(first, "Dropout", advance=False))
            if w is not None and w[1]:
                f.recipes[first] = f.noise[first]
        t = out[0] if isinstance(out, (tuple, list)) else out
        if not mutates and kind is not None and f.frames and isinstance(t, torch.Tensor):
            key = key_of(t)
            want = f.wanted.get(key)
            if want is not None:
                captured = self.capture(func, args, kwargs, want, out)
        if want is not None:
            rest = want[1]
            rargs, rkw = captured
            # a BatchNorm whose statistics stay reruns from them (see _normalize)
            stats = _batch_norm_stats(func, args, kwargs, out) if name in _BATCH_NORM and not rest else None
            siblings = []
            for i in (0,) + (_ALSO.get(kind, ()) if rest else ()):
                if i == 0 or (isinstance(out, (tuple, list)) and i < len(out) and isinstance(out[i], torch.Tensor)):
                    r = _Recipe(func, rargs, rkw, i, siblings, rng if name == "native_dropout" and rest else None,
                                stats)
                    # weak references: siblings do not keep each other alive
                    siblings.append(weakref.ref(r))
                    f.recipes[out[i] if i else t] = r
            f.found.add(key)
        elif mutates:
            f.changed(first)
        if self.stream is not None:
            k = self.kinds(func, args)
            if k is not None:
                # dropout is marked too: inductor reruns it from the seed forward drew
                # its mask from (compile_policy's checkpoint keeps no random state)
                self.stream.append((k, want is not None))
        return out

    def capture(self, func, args, kwargs, want, out=None):
        """The arguments a recipe keeps (see _Forward.capture)."""
        f = self.fwd
        name, rest = func.overloadpacket.__name__, want[1]
        if name == "native_dropout" and not rest:
            # the mask stays: applied again as the CPU kernel applies it
            return (f.capture(args[0]), _Held(out[1]), args[1]), {}
        rargs = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a in f.noise:
                # CPU dropout's noise: drawn again where the plan drops it too, else kept
                rargs.append(f.noise[a] if rest else _Held(a, a._version))
            elif name in _BATCH_NORM and i in (3, 4):
                # running statistics: the kernel updates them, the rerun does not read them
                rargs.append(f.capture(a, checked=False))
            else:
                rargs.append(tree_map(f.capture, a))
        return tuple(rargs), tree_map(f.capture, kwargs)


def _resolve(names, raw):
    """An exporter scope path -> (module path, call number), or None."""
    if raw in names:
        return raw, 0
    m = re.fullmatch(r"(.*)_(\d+)", raw)
    if m and m.group(1) in names:
        return m.group(1), int(m.group(2))
    return None


def _install(model, stream=None):
    """Installs the plan's hooks on `model`; returns their handles."""
    names = dict(model.named_modules())
    wanted = {}
    unknown = []
    for scope, op, rank, size, value, rest in RECOMPUTE:
        at = _resolve(names, scope)
        if at is None:
            unknown.append(value)
        else:
            wanted[at, op, size, rank] = (value, rest)
    live = []  # the forward being recorded, if any
    depth = [0]  # calls of the model itself under way (a model that calls itself)

    def enter(mod, args, _path):
        if live:
            f = live[-1]
            n = f.calls[_path]
            f.calls[_path] = n + 1
            f.frames.append(((_path, n), collections.Counter()))

    def leave(mod, args, out):
        if live and live[-1].frames:
            live[-1].frames.pop()

    def root_enter(mod, args):
        depth[0] += 1
        if live or depth[0] > 1 or not torch.is_grad_enabled():
            return
        f = _Forward(wanted)
        f.ctx = (torch.autograd.graph.saved_tensors_hooks(f.pack, _unpack), _Mode(f, stream))
        for c in f.ctx:
            c.__enter__()
        live.append(f)

    def root_leave(mod, args, out):
        # also called when forward raises (always_call): the hooks are taken off then too
        depth[0] -= 1
        if not live or depth[0] > 0:
            return
        f = live.pop()
        for c in reversed(f.ctx):
            c.__exit__(None, None, None)
        if out is None:  # forward raised: nothing to report
            f.ctx = f.recipes = f.held = f.noise = f.frames = None
            return
        model.memplan_missing = unknown + [v[0] for k, v in wanted.items() if k not in f.found]
        if model.memplan_missing and not getattr(model, "_memplan_warned", False):
            model._memplan_warned = True
            warnings.warn("memplan: %d of %d values to recompute were not found in this model's forward "
                          "and are kept (model.memplan_missing)" % (len(model.memplan_missing), len(RECOMPUTE)))
        f.ctx = f.recipes = f.held = f.noise = f.frames = None  # forward is over

    handles = [model.register_forward_pre_hook(root_enter)]
    for path, m in names.items():
        handles.append(m.register_forward_pre_hook(lambda mod, args, _p=path: enter(mod, args, _p)))
        handles.append(m.register_forward_hook(leave, always_call=True))
    handles.append(model.register_forward_hook(root_leave, always_call=True))
    return handles


def apply(model):
    """Recomputes the values of RECOMPUTE in `model`'s training steps; returns `model`.

    Every forward pass of `model` (with autograd recording) then drops those values
    and backward computes them again. `model.memplan_missing` lists the entries the
    last forward did not find (kept, as without the plan). Eager mode: for
    torch.compile see compile_policy."""
    if getattr(model, "_memplan_recompute", False):
        return model
    if getattr(model, "_memplan_compile_policy", False):
        raise ValueError("memplan: apply() on a model compile_policy() has already changed")
    _install(model)
    model._memplan_recompute = True
    return model


class _Kinds:
    """Names the aten ops of one forward as compile_policy matches them: BatchNorm's
    variants are one kind, an in-place op counts as its out-of-place one, and CPU
    dropout's empty_like, bernoulli_, div_ of the noise and mul are one "dropout", as
    native_dropout is (torch.compile traces either). None: an op not counted."""

    def __init__(self):
        self.noise = {}  # id -> the noise tensors of CPU dropout (held: ids stay unique)

    def __call__(self, func, args):
        name = func.overloadpacket.__name__
        if name == "empty_like":
            return None
        if name == "bernoulli_" and args and isinstance(args[0], torch.Tensor):
            self.noise[id(args[0])] = args[0]
            return None
        if any(isinstance(a, torch.Tensor) and id(a) in self.noise for a in args[:2]):
            return "dropout" if name == "mul" else None
        if name in _BATCH_NORM:
            return "batch_norm"
        if name == "native_dropout":
            return "dropout"
        if name == "_unsafe_view":
            return "view"
        return name[:-1] if name.endswith("_") else name


class _Stream(list):
    """The (kind, taken) of every op counted in one forward."""


def compile_policy(model, *args, **kwargs):
    """For torch.compile: makes the compiler recompute the values of RECOMPUTE; returns `model`.

    Runs one forward of `model` on `args` and `kwargs` (eager, with autograd; the
    random state and the buffers, such as BatchNorm's running statistics, are put
    back after it) to find the aten ops that compute those values, as apply() finds
    them. Then wraps `model.forward` in a selective activation checkpoint
    (torch.utils.checkpoint with create_selective_checkpoint_contexts) whose policy
    marks those ops MUST_RECOMPUTE and leaves every other op to the compiler
    (PREFER_SAVE). Call it before `model.compile()` or `torch.compile(model)`; the
    compiler's partitioner then reruns those ops in backward, fused with their
    neighbours, instead of saving them. A marked dropout reruns from the seed its
    forward drew the mask from (inductor's own random numbers), so the checkpoint keeps
    no random state (preserve_rng_state=False): keeping it made the compiler draw the
    numbers again through run_and_save_rng_state, a slower path. Dropout is not marked
    where its rerun may not come from that seed: with
    torch._inductor.config.fallback_random set (eager random numbers), and where
    dynamo runs the checkpoint eagerly (a graph break inside the forward).

    The compiler's ops are matched to the eager forward's by kind and rank (the k-th
    convolution), BatchNorm's variants one kind, CPU dropout's four ops one.
    `model.memplan_missing` lists the values the eager forward did not find;
    `model.memplan_compiled` says what was found and what the compiler's last trace did:
    "to_mark", the ops found, "dropouts_left" (dropouts kept, see above) and
    "missing", the values not marked, and "marked", the ops the trace marked;
    "first_difference" is None where its ops came in the eager forward's order, else
    (index, its op, the eager forward's op).
    In eager mode use apply(): run eagerly, the wrapped forward is the plain one (it
    warns once). PyTorch 2.4 or later; measured with 2.15."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    if getattr(model, "_memplan_recompute", False) or getattr(model, "_memplan_compile_policy", False):
        raise ValueError("memplan: compile_policy() on a model apply() or compile_policy() has already changed")
    stream = _Stream()
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    handles = _install(model, stream)
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    counts = collections.Counter()
    taken = set()
    for n, t in stream:
        if t:
            taken.add((n, counts[n]))
        counts[n] += 1
    kinds = {n for n, _ in taken}
    order = [n for n, _ in stream]
    stats = model.memplan_compiled = {"marked": 0, "to_mark": len(taken), "dropouts_left": 0,
                                      "missing": len(model.memplan_missing), "first_difference": None}

    def context():
        kind_of = (_Kinds(), _Kinds())  # forward, and the rerun (PyTorch that calls the policy again)
        seen = (collections.Counter(), collections.Counter())
        over = set()  # kinds of op the compiled forward runs more often than the eager one
        stats["marked"] = 0
        stats["dropouts_left"] = 0
        stats["first_difference"] = None
        at = [0]
        import torch._inductor.config as inductor_config

        keep_dropout = bool(inductor_config.fallback_random)

        def policy(ctx, func, *a, **kw):
            r = int(bool(getattr(ctx, "is_recompute", False)))
            n = kind_of[r](func, a)
            if n is None:
                return CheckpointPolicy.PREFER_SAVE
            k = seen[r][n]
            seen[r][n] += 1
            if not r:
                i = at[0]
                at[0] += 1
                if stats["first_difference"] is None and (i >= len(order) or order[i] != n):
                    stats["first_difference"] = (i, n, order[i] if i < len(order) else None)
                    warnings.warn("memplan: the compiled forward's op %d is %s where the eager forward ran %s; "
                                  "values are still matched by kind and rank (model.memplan_compiled)"
                                  % stats["first_difference"])
                if k == counts[n] and n in kinds and n not in over:
                    over.add(n)
                    warnings.warn("memplan: the compiled forward runs %s more often than the eager one (%d "
                                  "times); its further ops are left to the compiler" % (n, counts[n]))
            if (n, k) in taken and n not in over:
                # outside the compiler (dynamo ran the checkpoint eagerly, at a graph
                # break) a rerun would draw other numbers: dropout is then kept
                if n == "dropout" and (keep_dropout or not torch.compiler.is_compiling()):
                    stats["dropouts_left"] += 1 - r
                    return CheckpointPolicy.PREFER_SAVE
                stats["marked"] += 1 - r
                return CheckpointPolicy.MUST_RECOMPUTE
            return CheckpointPolicy.PREFER_SAVE

        return create_selective_checkpoint_contexts(policy)

    forward = model.forward
    warned = []

    def checkpointed(*a, **kw):
        if not torch.compiler.is_compiling():
            # eagerly, a marked dropout would rerun from other random numbers
            if not warned:
                warned.append(True)
                warnings.warn("memplan: compile_policy() is for torch.compile; run eagerly, the model "
                              "keeps every op's output (use apply() in eager mode)")
            return forward(*a, **kw)
        return checkpoint(lambda *x: forward(*x, **kw), *a, use_reentrant=False, context_fn=context,
                          preserve_rng_state=False)

    model._memplan_compile_policy = True
    model.forward = checkpointed
    return model
