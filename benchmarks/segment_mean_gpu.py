"""A mean merge on the GPU, three ways (issues 52 and 66): torch's scatter_reduce_(mean, include_self=False), one op
as a dispatch counter sees it; a sum by index_add_ times each row's inverse count (counts from a 1-D index_add_ of
ones); and the product with the map's 0/1 matrix (the backend's matrix_mean, its matrix built once per merge and
so left out of the timing) that tomesd/backends/torch.py takes below its break-even. Per size: the host time of
one call (no synchronisation) and its device time (CUDA events), median of 50, interleaved. Run on a GPU from the checkout: PYTHONPATH=. python benchmarks/segment_mean_gpu.py"""
import statistics
import time

import torch


def reduce_mean(x, rows, m):
    out = torch.empty((m, x.shape[1]), device=x.device, dtype=x.dtype)
    return out.scatter_reduce_(0, rows.unsqueeze(1).expand(x.shape), x, "mean", include_self=False)


def sum_times_inverse(x, rows, m, ones):
    counts = torch.zeros(m, device=x.device, dtype=torch.float32).index_add_(0, rows, ones)
    total = torch.zeros((m, x.shape[1]), device=x.device, dtype=x.dtype).index_add_(0, rows, x)
    return total * counts.reciprocal_().unsqueeze(1).to(x.dtype)


def main() -> None:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__)
    sizes = {"SD1.5 1024² (64² level)": (2, 16384, 320), "SD3 1024²": (2, 4096, 1536), "Flux 1024²": (2, 4096, 3072),
             "Wan 480x832x17": (2, 7800, 1536)}
    for name, (b, n, c) in sizes.items():
        for dtype in (torch.float16, torch.bfloat16):
            m = n // 2
            x = torch.randn(b * n, c, device=dev, dtype=dtype)
            rows = torch.randint(0, m, (b, n), device=dev)  # each sample's tokens into its own m rows
            rows[:, :m] = torch.arange(m, device=dev)  # every row gets at least one token
            rows = (rows + torch.arange(b, device=dev)[:, None] * m).reshape(-1)
            ones = torch.ones(b * n, device=dev)
            from tomesd.backends.torch import TorchArrays

            matrix = TorchArrays.merge_matrix(rows, b, n, m, x, force=True)
            inv = (1.0 / torch.zeros(b * m, device=dev).index_add_(0, rows, ones)).unsqueeze(1)
            ways = {"scatter_reduce_ mean": lambda: reduce_mean(x, rows, b * m),
                    "index_add_ x 1/count": lambda: sum_times_inverse(x, rows, b * m, ones),
                    "product with the 0/1 matrix": lambda: TorchArrays.matrix_mean(matrix, x, inv)}
            ref = ways["scatter_reduce_ mean"]().float()
            diff = {k: (f().float() - ref).abs().max().item() for k, f in ways.items()}
            host = {k: [] for k in ways}
            device = {k: [] for k in ways}
            for _ in range(5):
                for f in ways.values():
                    f()
            torch.cuda.synchronize()
            for _ in range(50):
                for k, f in ways.items():
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    start.record()
                    f()
                    end.record()
                    host[k].append(time.perf_counter() - t0)
                    torch.cuda.synchronize()
                    device[k].append(start.elapsed_time(end))
            if name.startswith("Flux") and dtype is torch.bfloat16:  # the kernels each way launches
                from torch.profiler import ProfilerActivity, profile
                for k, f in ways.items():
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        f()
                        torch.cuda.synchronize()
                    print(f"--- {k}: ops and kernels")
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
            for k in ways:
                print(f"{name} {str(dtype)[6:]} | {k} | host {1e6 * statistics.median(host[k]):.0f} us | device "
                      f"{1e3 * statistics.median(device[k]):.0f} us | max diff {diff[k]:.2e}")


if __name__ == "__main__":
    main()
