//! The last step: interleaved 8-bit RGB to planar (NCHW) `f32`, scaled to [0, 1] and normalised
//! with a mean and standard deviation per channel, written straight into the caller's buffer.

/// ImageNet channel means (RGB), as used by torchvision.
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// ImageNet channel standard deviations (RGB).
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// A table per channel from the 256 byte values to their normalised `f32`: one load per value
/// instead of a subtraction and a division.
#[derive(Clone)]
pub struct Normaliser {
    lut: [[f32; 256]; 3],
}

impl Normaliser {
    /// `(v / 255 - mean[c]) / std[c]`, computed as torchvision computes it (scale, then
    /// subtract and divide, in `f32`), so the table holds exactly torchvision's values.
    pub fn new(mean: [f32; 3], std: [f32; 3]) -> Normaliser {
        let mut lut = [[0f32; 256]; 3];
        for (c, table) in lut.iter_mut().enumerate() {
            for (v, x) in table.iter_mut().enumerate() {
                *x = (v as f32 / 255.0 - mean[c]) / std[c];
            }
        }
        Normaliser { lut }
    }

    /// The ImageNet normalisation.
    pub fn imagenet() -> Normaliser {
        Normaliser::new(IMAGENET_MEAN, IMAGENET_STD)
    }

    /// Writes `rgb` (interleaved, `plane` pixels) as three planes of `plane` floats into
    /// `out[..3 * plane]`. The caller checks the lengths.
    pub fn write_planes(&self, rgb: &[u8], plane: usize, out: &mut [f32]) {
        let (r, rest) = out[..3 * plane].split_at_mut(plane);
        let (g, b) = rest.split_at_mut(plane);
        let [lr, lg, lb] = &self.lut;
        for (((px, r), g), b) in rgb[..3 * plane]
            .chunks_exact(3)
            .zip(r.iter_mut())
            .zip(g.iter_mut())
            .zip(b.iter_mut())
        {
            *r = lr[usize::from(px[0])];
            *g = lg[usize::from(px[1])];
            *b = lb[usize::from(px[2])];
        }
    }
}

impl Normaliser {
    /// Normalises 8-bit planes (`3 × plane` bytes, as [`split_planes`] lays them out) into
    /// `out[..3 * plane]`: the same floats, bit for bit, as [`Normaliser::write_planes`] gives
    /// from the interleaved pixels. The caller checks the lengths.
    pub fn normalise_planes(&self, planes: &[u8], plane: usize, out: &mut [f32]) {
        for (c, (src, dst)) in planes[..3 * plane]
            .chunks_exact(plane)
            .zip(out[..3 * plane].chunks_exact_mut(plane))
            .enumerate()
        {
            let lut = &self.lut[c];
            for (v, x) in src.iter().zip(dst) {
                *x = lut[usize::from(*v)];
            }
        }
    }

    /// The table: `table()[c][v]` is the normalised value of byte `v` in channel `c` (for a
    /// consumer that normalises elsewhere, e.g. on a GPU).
    pub fn table(&self) -> &[[f32; 256]; 3] {
        &self.lut
    }
}

/// Writes `rgb` (interleaved, `plane` pixels) as three planes of `plane` bytes into
/// `out[..3 * plane]`. The caller checks the lengths.
pub fn split_planes(rgb: &[u8], plane: usize, out: &mut [u8]) {
    let (r, rest) = out[..3 * plane].split_at_mut(plane);
    let (g, b) = rest.split_at_mut(plane);
    for (((px, r), g), b) in rgb[..3 * plane]
        .chunks_exact(3)
        .zip(r.iter_mut())
        .zip(g.iter_mut())
        .zip(b.iter_mut())
    {
        *r = px[0];
        *g = px[1];
        *b = px[2];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planes_hold_torchvisions_values() {
        let n = Normaliser::imagenet();
        // Two pixels: pure red, then pure blue.
        let rgb = [255, 0, 0, 0, 0, 255];
        let mut out = [0f32; 6];
        n.write_planes(&rgb, 2, &mut out);
        let f = |v: f32, c: usize| (v / 255.0 - IMAGENET_MEAN[c]) / IMAGENET_STD[c];
        assert_eq!(
            out,
            [
                f(255.0, 0),
                f(0.0, 0),
                f(0.0, 1),
                f(0.0, 1),
                f(0.0, 2),
                f(255.0, 2)
            ]
        );
    }

    #[test]
    fn eight_bit_planes_normalise_to_the_same_floats() {
        let n = Normaliser::imagenet();
        let rgb: Vec<u8> = (0..3 * 100).map(|i| (i * 37 % 256) as u8).collect();
        let mut direct = vec![0f32; 300];
        n.write_planes(&rgb, 100, &mut direct);
        let mut planes = vec![0u8; 300];
        split_planes(&rgb, 100, &mut planes);
        let mut later = vec![0f32; 300];
        n.normalise_planes(&planes, 100, &mut later);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&direct), bits(&later));
        assert_eq!(n.table()[2][usize::from(rgb[3 * 85 + 2])], direct[200 + 85]);
    }
}
