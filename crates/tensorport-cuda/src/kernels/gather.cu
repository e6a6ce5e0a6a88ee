
struct TpCopies {
    unsigned long long src[32];
    unsigned long long dst[32];
    unsigned long long len[32];
};
extern "C" __global__ void tp_gather(const TpCopies c) {
    const unsigned int k = blockIdx.y;
    const unsigned long long n = c.len[k];
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (((c.src[k] | c.dst[k] | n) & 15ull) == 0) {
        const uint4* s = (const uint4*)c.src[k];
        uint4* d = (uint4*)c.dst[k];
        for (unsigned long long i = first; i < n / 16; i += stride) d[i] = s[i];
    } else {
        const unsigned char* s = (const unsigned char*)c.src[k];
        unsigned char* d = (unsigned char*)c.dst[k];
        for (unsigned long long i = first; i < n; i += stride) d[i] = s[i];
    }
}
