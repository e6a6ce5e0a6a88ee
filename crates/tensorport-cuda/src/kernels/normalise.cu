
extern "C" __global__ void tp_normalise_u8(const unsigned char* src, float* dst,
                                           const float* lut, unsigned long long plane,
                                           unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    dst[i] = lut[((i / plane) % 3) * 256 + src[i]];
}
