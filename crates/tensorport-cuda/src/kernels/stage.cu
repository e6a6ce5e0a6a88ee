
extern "C" __global__ void tp_f32_to_f16(const float* src, unsigned short* dst,
                                         unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(src[i]));
    dst[i] = h;
}
