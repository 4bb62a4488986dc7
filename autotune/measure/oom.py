"""What counts as running out of memory, as data: the messages a failed allocation raises (no
torch: the search's parent reads a probe's reason with them too)."""

from __future__ import annotations

__all__ = ["MARGIN_TAKEN", "OOM_MESSAGES"]

# How the reason of a run that had no room at all starts: before it began, other processes
# already held the memory margin. It says nothing about the run's batch size.
MARGIN_TAKEN = "other processes hold the memory margin"

OOM_MESSAGES: tuple[str, ...] = (
    "CUDA out of memory",  # the caching allocator, as older torch versions raised it
    "CUDA error: out of memory",  # a cudaMalloc outside the caching allocator
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS could not allocate its handle or workspace
    "CUDNN_STATUS_ALLOC_FAILED",  # cuDNN before 9
    "CUDNN_STATUS_NOT_ALLOC",  # an old cuDNN spelling of the same failure
    "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",  # cuDNN 9
    "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",  # cuDNN 9
    "DefaultCPUAllocator: can't allocate memory",  # host memory, on a CPU device
)
