// The GPU kernel's source (src/kernels/jpeg.cu) run on the CPU against PIL's two antialiased
// passes written out directly: for every output pixel, every channel and every source row of its
// vertical window, the row's horizontal sum (each weight computed where it is used) rounded to 8
// bits, then the vertical sum rounded again. The kernel keeps its horizontal weights and walks
// the rows once for all channels; its pixels must be the same, bit for bit, in 8-bit and in
// normalised f32 output — for enlargements, mild and strong shrinks (windows wider than the
// weights it keeps included), off-centre windows and images a pixel wide. CUDA's qualifiers become
// nothing and its thread indices plain globals the loops below set. Exit status 0 and "PASS".
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>
#include <algorithm>
struct D3 { int x, y, z; };
static D3 blockIdx, threadIdx, blockDim;
#define __device__
#define __global__
#define __forceinline__ inline
using std::min; using std::max;
#include "jpeg.cu"

// PIL's two passes for output pixel (x, y) of channel c, written out directly.
static float reference(const Job& j, int x, int y, int c) {
  const double cx = (double)j.left + (x + 0.5) * (double)j.sx;
  const double cy = (double)j.top + (y + 0.5) * (double)j.sy;
  int x0, x1, y0, y1;
  float ix, iy, nx, ny;
  taps(cx, j.sx, j.w, &x0, &x1, &ix, &nx);
  taps(cy, j.sy, j.h, &y0, &y1, &iy, &ny);
  const unsigned char* p = j.src + c * j.plane;
  float acc = 0.0f;
  for (int yy = y0; yy < y1; ++yy) {
    const unsigned char* row = p + (unsigned long long)yy * j.pitch;
    float h = 0.0f;
    for (int xx = x0; xx < x1; ++xx) h += tri((float)(xx - cx + 0.5) * ix) * nx * (float)row[xx];
    acc += tri((float)(yy - cy + 0.5) * iy) * ny * round_u8(h);
  }
  return round_u8(acc);
}

int main() {
  // (source w, h, window left, top, width, height): the window is resized to out × out.
  struct Case { int w, h; float left, top, ww, wh; int out; };
  const Case cases[] = {
      {500, 375, 62.5f, 0.0f, 375.0f, 375.0f, 224},  // a small photo: shrink 1.7
      {120, 160, 0.0f, 20.0f, 120.0f, 120.0f, 224},  // a thumbnail: enlarged
      {4000, 3000, 500.0f, 0.0f, 3000.0f, 3000.0f, 64},  // shrink 47: wider than the kept weights
      {1920, 1080, 420.0f, 0.0f, 1080.0f, 1080.0f, 48},  // shrink 22.5
      {640, 480, 80.3f, 7.7f, 470.1f, 466.9f, 224},  // off-centre, fractional window
      {1, 37, 0.0f, 0.0f, 1.0f, 37.0f, 16},  // a pixel wide
      {33, 1, 0.0f, 0.0f, 33.0f, 1.0f, 16},  // a pixel high
  };
  unsigned seed = 12345;
  int bad = 0, checked = 0;
  for (const Case& k : cases) {
    const int pitch = k.w + 3;  // rows padded, as the decoder's are
    std::vector<unsigned char> src((size_t)pitch * k.h * 3);
    for (auto& v : src) { seed = seed * 1103515245u + 12345u; v = (seed >> 16) & 255; }
    // Smooth stretches as well as noise: rows of a gradient every few rows.
    for (int y = 0; y < k.h; y += 5) for (int x = 0; x < k.w; ++x) src[(size_t)y * pitch + x] = (x * 7) & 255;
    for (int as_u8 = 0; as_u8 < 2; ++as_u8) {
      std::vector<float> dst((size_t)3 * k.out * k.out);
      Job job;
      job.src = src.data(); job.pitch = pitch; job.plane = (unsigned long long)pitch * k.h;
      job.w = k.w; job.h = k.h; job.left = k.left; job.top = k.top;
      job.sx = k.ww / k.out; job.sy = k.wh / k.out; job.dst = dst.data();
      const float m[3] = {0.485f, 0.456f, 0.406f}, s[3] = {0.229f, 0.224f, 0.225f};
      blockDim = {std::min(k.out, 256), 1, 1};
      for (int by = 0; by < k.out; ++by) for (int bx = 0; bx * blockDim.x < k.out; ++bx)
        for (int t = 0; t < blockDim.x; ++t) {
          blockIdx = {bx, by, 0}; threadIdx = {t, 0, 0};
          tp_resize_normalise(&job, k.out, as_u8, m[0], m[1], m[2], s[0], s[1], s[2]);
        }
      const unsigned char* u8 = (const unsigned char*)dst.data();
      for (int c = 0; c < 3; ++c) for (int y = 0; y < k.out; ++y) for (int x = 0; x < k.out; ++x) {
        const float want = reference(job, x, y, c);
        const size_t at = ((size_t)c * k.out + y) * k.out + x;
        bool same;
        if (as_u8) {
          same = u8[at] == (unsigned char)want;
        } else {
          const float f = (want / 255.0f - m[c]) / s[c];
          same = std::memcmp(&f, &dst[at], sizeof f) == 0;
        }
        ++checked;
        if (!same && bad++ < 5)
          printf("%dx%d -> %d, %s, channel %d, pixel (%d, %d): kernel and reference differ\n",
                 k.w, k.h, k.out, as_u8 ? "u8" : "f32", c, x, y);
      }
    }
  }
  printf("%d pixels checked, %d differ\n", checked, bad);
  if (bad) return 1;
  printf("PASS\n");
  return 0;
}
