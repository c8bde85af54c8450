"""Checks shared by the checkpoint tests: nested state equal bit for bit, and DCP's own
template flow (a fresh job's state as the template, ``dcp.load`` into it, ``set_state_dict``)."""
import torch

__all__ = ["assert_same", "dcp_round_trip"]


def assert_same(a, b, where=""):
    """Nested dicts / lists / tensors equal: the same keys, and tensors of one dtype, bit for bit."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, set(a) ^ set(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def dcp_round_trip(saved, saved_opt, fresh, fresh_opt, where):
    """Save ``saved`` / ``saved_opt`` with DCP (one process) at ``where`` and load it into the
    fresh job ``fresh`` / ``fresh_opt`` as DCP's users do: the fresh job's ``get_state_dict`` is
    the template (only its names are loaded), then ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(saved, saved_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=where, no_dist=True)
    model_t, optim_t = get_state_dict(fresh, fresh_opt)
    template = {"model": model_t, "optim": optim_t}
    dcp.load(template, checkpoint_id=where, no_dist=True)
    set_state_dict(fresh, fresh_opt, model_state_dict=template["model"],
                   optim_state_dict=template["optim"])
