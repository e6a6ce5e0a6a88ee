
typedef unsigned long long u64;
typedef unsigned int u32;
// Images of `channels` planes of `plane` NCHW floats at x into y in the element type: the same
// order, or channels last (`nhwc`). Grid: (ceil(plane / 256), images).
extern "C" __global__ void tp_net_convert(const float* x, T* y, u32 channels, u32 plane,
                                          int nhwc) {
    u32 p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= plane) return;
    u64 base = (u64)blockIdx.y * channels * plane;
    const float* src = x + base + p;
    for (u32 c = 0; c < channels; c++)
        st(y, base + (nhwc ? (u64)p * channels + c : (u64)c * plane + p), src[(u64)c * plane]);
}
// y = relu(y + bias[channel] + z), z optional (0), for images of `channels` x `plane` values.
// Grid: (ceil(channels * plane / 256), images).
extern "C" __global__ void tp_net_epilogue(T* y, const float* bias, const T* z, u32 plane,
                                           u32 channels, int nhwc) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= channels * plane) return;
    u64 at = (u64)blockIdx.y * channels * plane + i;
    float v = ld(y, at) + bias[nhwc ? i % channels : i / plane];
    if (z) v += ld(z, at);
    st(y, at, v > 0.0f ? v : 0.0f);
}
// NCHW: one block of 256 threads per (image, channel) plane of `plane` values: its mean.
extern "C" __global__ void tp_net_mean(const T* x, float* out, u32 plane) {
    __shared__ float part[256];
    const T* row = x + (u64)blockIdx.x * plane;
    float s = 0.0f;
    for (u32 j = threadIdx.x; j < plane; j += blockDim.x) s += ld(row, j);
    part[threadIdx.x] = s;
    __syncthreads();
    for (u32 k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) part[threadIdx.x] += part[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = part[0] / (float)plane;
}
// NHWC, first pass: block (b, image) sums pixels [b * 64, b * 64 + 64) of the image, for
// every channel, into part[image][b][channel]. With at most 256 channels, thread t sums
// channel t % channels over every (256 / channels)-th of those pixels (neighbouring threads
// read neighbouring values); with more, thread t sums channels t, t + 256, ... Grid:
// (ceil(plane / 64), images), 256 threads.
extern "C" __global__ void tp_net_mean_nhwc(const T* x, float* part, u32 plane, u32 channels) {
    __shared__ float acc[256];
    const T* img = x + (u64)blockIdx.y * plane * channels;
    float* o = part + ((u64)blockIdx.y * gridDim.x + blockIdx.x) * channels;
    u32 first = blockIdx.x * 64, last = min(first + 64, plane);
    u32 t = threadIdx.x;
    if (channels > blockDim.x) {
        for (u32 c = t; c < channels; c += blockDim.x) {
            float s = 0.0f;
            for (u32 j = first; j < last; j++) s += ld(img, (u64)j * channels + c);
            o[c] = s;
        }
        return;
    }
    u32 groups = blockDim.x / channels;
    float s = 0.0f;
    if (t < groups * channels)
        for (u32 j = first + t / channels; j < last; j += groups)
            s += ld(img, (u64)j * channels + t % channels);
    acc[t] = s;
    __syncthreads();
    if (t < channels) {
        float a = 0.0f;
        for (u32 g = 0; g < groups; g++) a += acc[g * channels + t];
        o[t] = a;
    }
}
// NHWC, second pass: out[image][c] = the image's `chunks` partial sums of channel c, over
// `plane`. Grid: (ceil(channels / 256), images), 256 threads.
extern "C" __global__ void tp_net_mean_sum(const float* part, float* out, u32 chunks,
                                           u32 channels, u32 plane) {
    u32 c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const float* p = part + (u64)blockIdx.y * chunks * channels + c;
    float s = 0.0f;
    for (u32 b = 0; b < chunks; b++) s += p[(u64)b * channels];
    out[(u64)blockIdx.y * channels + c] = s / (float)plane;
}
// The first layer when it cuts the image into patches (kernel side = stride, no padding): from
// the NCHW floats x straight to y in the element type and layout, with the bias and ReLU,
// accumulating in fp32. w: [STEM_K][STEM_C][STEM_S][STEM_S] floats, bias: [STEM_K] floats.
// One thread per output pixel. Grid: (ceil(oh * ow / 128), images), 128 threads.
#define STEM_W (STEM_K * STEM_C * STEM_S * STEM_S)
extern "C" __global__ void tp_net_stem(const float* x, const float* w, const float* bias, T* y,
                                       u32 h, u32 wd, u32 oh, u32 ow, int nhwc) {
    // Weights as [c][r][s][k]: one input value meets its STEM_K weights side by side.
    __shared__ __align__(16) float ws[STEM_W];
    __shared__ float bs[STEM_K];
    for (u32 i = threadIdx.x; i < STEM_W; i += blockDim.x) {
        u32 k = i / (STEM_C * STEM_S * STEM_S), crs = i % (STEM_C * STEM_S * STEM_S);
        ws[crs * STEM_K + k] = w[i];
    }
    for (u32 i = threadIdx.x; i < STEM_K; i += blockDim.x) bs[i] = bias[i];
    __syncthreads();
    u32 npix = oh * ow;
    u32 p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= npix) return;
    u32 r0 = (p / ow) * STEM_S, c0 = (p % ow) * STEM_S;
    const float* img = x + (u64)blockIdx.y * STEM_C * h * wd;
    float acc[STEM_K];
#pragma unroll
    for (int k = 0; k < STEM_K; k++) acc[k] = bs[k];
    for (int c = 0; c < STEM_C; c++) {
#pragma unroll
        for (int r = 0; r < STEM_S; r++) {
            const float* row = img + ((u64)c * h + r0 + r) * wd + c0;
#pragma unroll
            for (int s = 0; s < STEM_S; s++) {
                float v = row[s];
                const float* wk = ws + ((c * STEM_S + r) * STEM_S + s) * STEM_K;
#pragma unroll
                for (int k = 0; k < STEM_K; k++) acc[k] = fmaf(v, wk[k], acc[k]);
            }
        }
    }
    u64 out = (u64)blockIdx.y * STEM_K * npix;
    if (nhwc) {
        T* dst = y + out + (u64)p * STEM_K;
        if ((STEM_K * sizeof(T)) % 16 == 0) {
            __align__(16) T tmp[STEM_K];
#pragma unroll
            for (int k = 0; k < STEM_K; k++) st(tmp, k, acc[k] > 0.0f ? acc[k] : 0.0f);
#pragma unroll
            for (int q = 0; q < (int)(STEM_K * sizeof(T) / 16); q++)
                ((uint4*)dst)[q] = ((const uint4*)tmp)[q];
        } else {
#pragma unroll
            for (int k = 0; k < STEM_K; k++) st(dst, k, acc[k] > 0.0f ? acc[k] : 0.0f);
        }
    } else {
#pragma unroll
        for (int k = 0; k < STEM_K; k++)
            st(y, out + (u64)k * npix + p, acc[k] > 0.0f ? acc[k] : 0.0f);
    }
}
