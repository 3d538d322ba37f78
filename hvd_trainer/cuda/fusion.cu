// Bucket gather and scatter kernels of fusion.py; ITEM is replaced by an unsigned type of
// the dtype's width, one module per width.
__device__ int member_of(const long long* starts, int n, long long i) {
    int lo = 0, hi = n - 1;  // the last member whose start is <= i (skips empty members)
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (starts[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
}

extern "C" __global__ void gather_ITEM(const unsigned long long* ptrs, const long long* starts,
                                       int n, ITEM* flat, long long total) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)blockDim.x * gridDim.x) {
        int m = member_of(starts, n, i);
        flat[i] = ((const ITEM*)ptrs[m])[i - starts[m]];
    }
}

extern "C" __global__ void scatter_ITEM(const unsigned long long* ptrs, const long long* starts,
                                        int n, const ITEM* flat, long long total) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)blockDim.x * gridDim.x) {
        int m = member_of(starts, n, i);
        ((ITEM*)ptrs[m])[i - starts[m]] = flat[i];
    }
}
