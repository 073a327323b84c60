"""Capture the AOTAutograd graphs of a TE model without a GPU (:func:`capture_aot`): the joint,
forward and backward ATen graphs Inductor's custom-pass hooks see, with a ``stage_hook`` there.

See docs/internals.md#te_passestestingcapturepy (step 2)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree

from te_passes.fx.graph import copy_graph_module
from te_passes.testing.captured import CapturedAOT, CapturedGraph
from te_passes.testing.dynamo_capture import UB_OVERLAP_FLAGS, capture_dynamo, first_line
from te_passes.testing.fake_gpu import CaptureError, capture_lock, constructing, fake_gpu, quiet


def _to_device(t: Any, mode, device: str) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    with mode, (constructing() if device == "cuda" else contextlib.nullcontext()):
        out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    if t.requires_grad:
        out.requires_grad_(True)
    return out


def _retarget_devices(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``device=meta`` constants (none are expected) to ``cuda``; returns how many."""
    meta, cuda = torch.device("meta"), torch.device("cuda", 0)
    n_changed = 0

    def fix(a):
        nonlocal n_changed
        if isinstance(a, torch.device) and a == meta:
            n_changed += 1
            return cuda
        return a

    for node in gm.graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, fix)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, fix)
    if n_changed:
        gm.recompile()
    return n_changed


def _repropagate_cuda(gm: torch.fx.GraphModule, mode) -> list[Any]:
    """Re-run ``gm`` on fake ``cuda`` inputs (``FakeTensorProp``) so every ``meta["val"]`` is on
    ``cuda:0``; returns those inputs."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    _retarget_devices(gm)
    inputs = [_to_device(n.meta.get("val"), mode, "cuda") for n in gm.graph.find_nodes(op="placeholder")]
    with torch.no_grad():
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    return inputs


class _HookError(Exception):
    """Wraps an exception raised by a ``stage_hook`` (re-raised unwrapped by :func:`capture_aot`)."""


def _reraise_hook_error(e: BaseException) -> None:
    """Re-raise the ``stage_hook``'s own exception if ``e`` wraps one (at any depth)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, _HookError) and e.__cause__ is not None:
            raise e.__cause__
        e = e.__cause__ or e.__context__


class _StopAtHook(Exception):
    """Raised by the recording ``post_grad_custom_pre_pass``: nothing after the hook runs."""


#: ``stage_hook(stage, gm, example_inputs)``: called where Inductor's custom-pass hooks run, on
#: the live graph (it may rewrite it in place, as the backend's passes do); ``stage`` is
#: ``"joint"``, ``"post_grad_fwd"`` or ``"post_grad_bwd"``.
StageHook = Callable[[str, torch.fx.GraphModule, list[Any]], None]


def _recording_pass(sink: dict, key: str, stop: bool, hook: Callable[[torch.fx.GraphModule], None] | None = None):
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Record(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            gm = graph.owning_module
            if hook is not None:
                try:
                    hook(gm)
                except Exception as e:  # noqa: BLE001 - re-raised by capture_aot
                    raise _HookError() from e
            sink[key] = gm if stop else copy_graph_module(gm)
            if stop:
                raise _StopAtHook()

        def uuid(self) -> str:
            return f"te_passes.testing.capture.{key}"

    return _Record()


def _post_grad_prefix(gm: torch.fx.GraphModule, mode, is_inference: bool, stage: str,
                      stage_hook: StageHook | None = None) -> tuple[torch.fx.GraphModule, list[Any]]:
    """Bring a partitioned graph to the state Inductor's ``post_grad_custom_pre_pass`` sees it
    in: ``view_to_reshape``, fake-tensor propagation (on fake ``cuda`` inputs), then
    ``post_grad_passes`` up to the custom pre-pass hook (``eliminate_dead_code``, ...), where a
    recording pass (after ``stage_hook``) stops it (torch 2.14 ``compile_fx._compile_fx_inner``
    → ``fx_codegen_and_compile``)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.fx_passes.post_grad import post_grad_passes, view_to_reshape

    view_to_reshape(gm)
    inputs = _repropagate_cuda(gm, mode)
    sink: dict[str, Any] = {}
    hook = None if stage_hook is None else (lambda g: stage_hook(stage, g, inputs))
    try:
        with inductor_config.patch(post_grad_custom_pre_pass=_recording_pass(sink, "post_grad", True, hook)):
            post_grad_passes(gm, is_inference=is_inference)
    except _StopAtHook:
        pass
    if "post_grad" not in sink:  # pragma: no cover - Inductor without the hook
        raise CaptureError("Inductor's post_grad_passes did not reach post_grad_custom_pre_pass")
    gm = sink["post_grad"]
    gm.recompile()
    return gm, inputs


def _unflatten_like(structure: Any, flat: list[Any]) -> Any:
    """``flat`` (leaves in order) shaped like ``structure`` (AOT's joint inputs are
    ``[primals, tangents]``)."""
    leaves, spec = torch.utils._pytree.tree_flatten(structure)
    if len(leaves) != len(flat):  # pragma: no cover - placeholders always match the leaves
        raise CaptureError(f"joint graph has {len(flat)} placeholders for {len(leaves)} inputs")
    return torch.utils._pytree.tree_unflatten(flat, spec)


def capture_aot(model: str | None = "linear", precision: str = "fp8-cs", layers: int = 1,
                tokens: int = 32, hidden: int = 64, out_features: int | None = None, *,
                training: bool = True, partitioner: str = "min_cut",
                dynamo: CapturedGraph | None = None, stage_hook: StageHook | None = None,
                **kwargs: Any) -> CapturedAOT:
    """Capture the AOTAutograd graphs (joint, forward, backward) of a TE model without a GPU
    (docs/internals.md#capture_aot).

    Args:
        model, ..., **kwargs: as for :func:`capture_dynamo` (unused with ``dynamo``; its
            ``training`` applies).
        partitioner: ``"min_cut"`` (Inductor's) or ``"default"`` (``aot_eager``'s
            ``default_partition``: the backward re-runs a dead ``linear.default``).
        dynamo: a :class:`CapturedGraph` to lower instead of capturing one (not modified).
        stage_hook: called on the live graph where ``joint_custom_pre_pass`` (``"joint"``) and
            ``post_grad_custom_pre_pass`` (``"post_grad_fwd"`` / ``"post_grad_bwd"``) run (see
            :data:`StageHook`); the graphs are recorded after it.

    Returns:
        :class:`CapturedAOT` (``backward`` / ``joint`` are ``None`` for ``training=False``).

    Raises:
        CaptureError: as :func:`capture_dynamo`, or AOTAutograd failed (chained).
    """
    if dynamo is None:
        dynamo = capture_dynamo(model, precision, layers, tokens, hidden, out_features,
                                training=training, **kwargs)
    training = dynamo.training
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import default_partition
    from torch._inductor import compile_fx as inductor_compile_fx
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    if partitioner not in ("min_cut", "default"):
        raise CaptureError(f"unknown partitioner {partitioner!r}; expected 'min_cut' or 'default'")

    rec: dict[str, Any] = {}

    def joint_hook(gm):
        if stage_hook is not None:
            stage_hook("joint", gm, rec["joint_inputs"])

    def partition_fn(joint, joint_inputs, **kw):
        # Inductor's joint passes must see cuda values: its constant folder treats any
        # meta-device value as a known constant and would replace TE op outputs.
        cuda_inputs = _repropagate_cuda(joint, mode)
        rec["joint_inputs"] = cuda_inputs
        if partitioner == "default":
            kw["partitioner_fn_override"] = default_partition
        fw, bw = inductor_compile_fx.partition_fn(joint, _unflatten_like(joint_inputs, cuda_inputs), **kw)
        rec["forward"], rec["backward"] = fw, bw
        return fw, bw

    def inference_compiler(gm, example_inputs):
        rec["forward"] = gm
        return gm.forward

    gm = copy_graph_module(dynamo.gm)
    fake_ub = any(bool(dynamo.linear_kwargs.get(k)) for k in UB_OVERLAP_FLAGS)
    with capture_lock, quiet(), fake_gpu(dynamo.precision, fake_ub=fake_ub):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        meta_inputs = [_to_device(t, mode, "meta") for t in dynamo.example_inputs]
        try:
            with mode, (contextlib.nullcontext() if training else torch.no_grad()), \
                    inductor_config.patch(joint_custom_pre_pass=_recording_pass(rec, "joint", False, joint_hook)):
                aot_module_simplified(gm, meta_inputs, fw_compiler=lambda g, _: g.forward,
                                      bw_compiler=lambda g, _: g.forward,
                                      inference_compiler=inference_compiler, partition_fn=partition_fn,
                                      decompositions=select_decomp_table(),
                                      keep_inference_input_mutations=True)
        except Exception as e:  # noqa: BLE001
            _reraise_hook_error(e)
            raise CaptureError(f"AOTAutograd on {dynamo.model} x{dynamo.layers} {dynamo.precision} failed: "
                               f"{type(e).__name__}: {first_line(e)}") from e
        fw, bw, joint = rec.get("forward"), rec.get("backward"), rec.get("joint")
        if fw is None:
            raise CaptureError("AOTAutograd produced no forward graph")
        try:
            fw, fw_inputs = _post_grad_prefix(fw, mode, bw is None, "post_grad_fwd", stage_hook)
            bw_inputs: list[Any] = []
            if bw is not None:
                bw, bw_inputs = _post_grad_prefix(bw, mode, False, "post_grad_bwd", stage_hook)
            joint_inputs = _repropagate_cuda(joint, mode) if joint is not None else []
        except CaptureError:
            raise
        except Exception as e:  # noqa: BLE001
            _reraise_hook_error(e)
            raise CaptureError(f"post-grad preparation of {dynamo.model} x{dynamo.layers} {dynamo.precision} "
                               f"failed: {type(e).__name__}: {first_line(e)}") from e
    return CapturedAOT(forward=fw, backward=bw, joint=joint, forward_inputs=fw_inputs,
                       backward_inputs=bw_inputs, joint_inputs=joint_inputs, dynamo=dynamo,
                       partitioner=partitioner)
