"""`fsdp_kit.ac.count_copies`: what it records and what it leaves out, the methods it puts back, and the calls it sees inside backward
(where a TorchFunctionMode would see nothing). Lesson 04c_ac counts FSDP2's offload copies with it."""
import pytest
import torch
from fsdp_kit.ac import count_copies, copies_by_site

pytestmark = pytest.mark.timeout(60)
METHODS = ("to", "cpu", "cuda", "copy_")


def test_no_op_and_real_copy():
    t = torch.ones(4, 8)  # 128 bytes of float32, on the CPU
    with count_copies() as calls:
        same = t.to("cpu")
        half = t.to("cpu", torch.float16)
        also = t.cpu()
        dev = t.to(device=torch.device("cpu"), non_blocking=True)
        like = t.to(torch.zeros(1, dtype=torch.float64))  # names a device through a tensor, and a dtype
    assert same is t and also is t and dev is t
    assert [(c.method, c.src, c.dst, c.nbytes, c.copied) for c in calls] == [
        ("to", "cpu", "cpu", 128, False), ("to", "cpu", "cpu", 128, True), ("cpu", "cpu", "cpu", 128, False),
        ("to", "cpu", "cpu", 128, False), ("to", "cpu", "cpu", 128, True)]
    assert half.dtype == torch.float16 and like.dtype == torch.float64
    assert {c.site for c in calls} == {f"{__name__}.test_no_op_and_real_copy"}  # the caller, not the wrapper


def test_what_it_leaves_out():
    t = torch.ones(3)
    with count_copies() as calls:
        t.to(torch.float64)  # a dtype alone names no device
        t.to(dtype=torch.float16)
        torch.zeros(3).copy_(t)  # a copy within one device
        t.to(torch.float16, False, True)  # non_blocking and copy given by position are not devices
    assert calls == []


def test_backward_hooks_are_seen():
    x = torch.ones(5, requires_grad=True)
    x.register_hook(lambda g: g.to("cpu"))
    with count_copies() as calls: (2 * x).sum().backward()
    assert [(c.method, c.nbytes, c.copied, c.site.rsplit(".", 1)[-1]) for c in calls] == [("to", 20, False, "<lambda>")]
    assert torch.equal(x.grad, torch.full((5,), 2.0))


def test_methods_put_back_even_after_an_error():
    before = {m: torch.Tensor.__dict__.get(m) for m in METHODS}
    with pytest.raises(ValueError):
        with count_copies(): raise ValueError("inside")
    assert {m: torch.Tensor.__dict__.get(m) for m in METHODS} == before
    assert torch.Tensor.to is torch._C.TensorBase.to


def test_nested_both_record():
    t = torch.ones(2)
    with count_copies() as outer:
        t.cpu()
        with count_copies() as inner: t.to("cpu")
    assert [c.method for c in outer] == ["cpu", "to"] and [c.method for c in inner] == ["to"]
    assert {c.site for c in outer + inner} == {f"{__name__}.test_nested_both_record"}
    assert torch.Tensor.to is torch._C.TensorBase.to


def test_grouped_by_site():
    t = torch.ones(10)
    with count_copies() as calls:
        for _ in range(3): t.to("cpu")
        t.to("cpu", torch.float64)
    site = f"{__name__}.test_grouped_by_site"
    assert copies_by_site(calls) == {(site, "cpu -> cpu", False): dict(calls=3, bytes=120),
                                     (site, "cpu -> cpu", True): dict(calls=1, bytes=40)}
