"""Fresh CPU tensors backed by transparent huge pages, so that writing them costs few page faults.

A large tensor of glibc's allocator is a new mapping: its first write faults once per 4 KiB page
(about 25 ms for 64 MiB on a small VM, several times the write itself). Marking the mapping's
2 MiB-aligned interior ``MADV_HUGEPAGE`` before the first write (Linux ``madvise(2)``; what torch
does for every allocation with ``THP_MEM_ALLOC_ENABLE=1``) lets the kernel map it in 2 MiB pages.
Elsewhere, or where the system refuses (transparent huge pages set to ``never``), the tensor is an
ordinary one: only its speed differs.
"""

import ctypes
import sys
from typing import Optional

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
MIN_BYTES = 2 * HUGE_PAGE  # below this no whole huge page fits reliably
_madvise: Optional[object] = None
_looked_up = False


def madvise_function():
    """libc's ``madvise`` (None off Linux or when it cannot be found)."""
    global _madvise, _looked_up
    if not _looked_up:
        _looked_up = True
        if sys.platform.startswith("linux"):
            try:
                function = ctypes.CDLL(None, use_errno=True).madvise
                function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
                _madvise = function
            except (OSError, AttributeError):
                _madvise = None
    return _madvise


def huge_page_range(address: int, nbytes: int):
    """The 2 MiB-aligned ``(start, length)`` inside ``[address, address + nbytes)`` (length 0 if none)."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return start, max(0, end - start)


def empty_like_on_huge_pages(reference: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(reference, contiguous)``, its memory advised to huge pages before any write
    (module doc) when it is on CPU and large enough."""
    return advised(torch.empty_like(reference, memory_format=torch.contiguous_format))


def empty_on_huge_pages(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape, dtype, device)``, advised as :func:`empty_like_on_huge_pages`."""
    return advised(torch.empty(shape, dtype=dtype, device=device))


def zeros_on_huge_pages(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape, dtype, device)`` on memory advised as :func:`empty_like_on_huge_pages`
    (a dense per-sample table of an embedding: ``B`` times the weight, zeroed then scattered into)."""
    return empty_on_huge_pages(shape, dtype, device).zero_()


def advised(out: torch.Tensor) -> torch.Tensor:
    """``out`` (not yet written), its memory advised to huge pages when on CPU and large enough."""
    nbytes = out.numel() * out.element_size()
    madvise = madvise_function() if out.device.type == "cpu" and nbytes >= MIN_BYTES else None
    if madvise is not None:
        start, length = huge_page_range(out.data_ptr(), nbytes)
        if length:
            madvise(start, length, MADV_HUGEPAGE)  # a refusal leaves ordinary pages: nothing to undo
    return out


def batched_outer_sums(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``out[b] = left[b]ᵀ · right[b]`` for ``left (B, T, o)``, ``right (B, T, i)``: ``(B, o, i)``,
    the per-sample gradients of a ``Linear`` weight. Large CPU results are written into memory
    advised to huge pages (module doc: a batch of weight-sized gradients is the largest fresh
    tensor of a step, its page faults several times its write); the numbers are ``torch.bmm``'s,
    the same as ``torch.einsum("bto,bti->boi", left, right)``. Where autograd records the
    product (``out=`` cannot be differentiated) it is the plain ``bmm``."""
    left_t = left.transpose(1, 2)
    recorded = torch.is_grad_enabled() and (left.requires_grad or right.requires_grad)
    if recorded or left.device.type != "cpu" or left.dtype != right.dtype:
        return torch.bmm(left_t, right)
    out = empty_on_huge_pages((left.shape[0], left.shape[2], right.shape[2]), left.dtype, left.device)
    return torch.bmm(left_t, right, out=out)
