"""The rows of fused experts modules, a part of :class:`~.capture.Capture`: one forward hook per
experts module for all its projections (each layout through its adapter,
:mod:`torch_impl.kronecker.experts`). The rows are recomputed from the call's inputs and the
gradient of its output in that output's gradient hook, under the autocast state the forward
ran in and with the dtypes its forward computed in (read in the forward hook:
:mod:`torch_impl.kronecker.experts.arithmetic`), and each routed pair reads its token's
mask; pairing, recomputes, masks and the self-check are the capture's own
(``torch_impl/kronecker/experts/README.md``)."""
import torch

from .guards import _guarded, _in_backward, _named_error, _untracked

__all__ = ["ExpertRows"]


class ExpertRows:
    """The hooks of the fused experts modules of ``capture`` (module docstring)."""

    def __init__(self, capture):
        self.capture = capture

    def _commit_rows(self, layers, module, inputs, grad, ctx, found, arithmetic):
        """Commit one call's statistics of every projection of a fused experts module from
        the gradient of its output (the layout adapter's ``rows``, with the ``arithmetic``
        its ``observe`` read of the forward); ``found``: the layout of the call's token rows,
        followed to each routed pair through its token."""
        capture = self.capture
        with _untracked(ctx):
            projection = layers[0].module
            token, expert, rows = projection.layout.rows(module, inputs, grad, arithmetic,
                                                         projection.expert_shard)
            mask = None if found.mask is None else found.mask[token]
            checking = capture.check.checking
            for layer, (a, g) in zip(layers, rows):
                capture.calls.note(layer, found, ctx)
                sketch = capture.check.sketch(layer, a, experts=expert) if checking else None
                capture.commit(layer, capture.statistics.input(layer, a, mask, experts=expert),
                               mask, g, sketch, experts=expert)

    def hooks(self, layers):
        """One forward hook on a fused experts module for its projections ``layers``: the
        rows are recomputed in the gradient hook of the call's output, so a call that is
        never back-propagated (a non-reentrant recompute) adds nothing, and a reentrant
        recompute adds its call once, with the layout its first pass recorded."""
        capture = self.capture
        module = layers[0].module.experts
        first = layers[0]

        def experts_hook(module, args, kwargs, output):
            state = capture.active(module)
            if state is None or not isinstance(output, torch.Tensor):
                return
            if state == "eval":
                if output.requires_grad:
                    capture.eval_seen.update(layer.name for layer in layers)
                return
            inputs = layers[0].module.layout.bind(module, args, kwargs,
                                                  layers[0].module.expert_shard)
            hidden = inputs[0]
            lead = tuple(hidden.shape[:-1])

            def tags_of(tracker):
                tag = tracker.tag_of(hidden)
                return None if tag is None or len(tag) < 2 else tag[:-1]
            if state == "first pass":
                for layer in layers:
                    capture.calls.first_pass(layer, tags_of, lead)
                return
            if not output.requires_grad:
                return
            ctx = capture.calls.context()
            replay = _in_backward()
            found = None if replay else capture.calls.layout(first, ctx, tags_of, lead)
            device = inputs[0].device.type  # the rows are recomputed as the forward ran them
            autocast = (device, torch.get_autocast_dtype(device),
                        torch.is_autocast_enabled(device))
            with _untracked(ctx):  # the dtypes it computed in, read from the forward itself
                arithmetic = layers[0].module.layout.observe(module, inputs)
            if not replay:
                for layer in layers:
                    capture.captured(layer)

            def hook(grad):
                try:
                    layout = capture.calls.replayed(first, ctx, lead) if replay else found
                    with torch.autocast(autocast[0], dtype=autocast[1], enabled=autocast[2]):
                        self._commit_rows(layers, module, inputs, grad, ctx, layout,
                                          arithmetic)
                except Exception as exc:  # noqa: BLE001 - named, never swallowed
                    raise _named_error(first, exc) from exc
                for layer in layers:
                    capture.committed(layer, counted=not replay)
            output.register_hook(hook)

        # the module, or the call inside its forward that multiplies this rank's rows
        # (transformers' expert-parallel dispatch)
        target = first.module.layout.hook_target(module, first.module.expert_shard)
        return [(target, "forward", _guarded(first, experts_hook))]
