//! The geometry of a transform: what size the image is resized to and which window of it is
//! kept. No pixels here; unit-tested against torchvision's rules.

/// What a producer does to an image before normalising it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transform {
    /// The standard evaluation transform (torchvision's `Resize(resize)` then
    /// `CenterCrop(crop)`): resize so the shorter side is `resize` (antialiased bilinear), keep
    /// the centred `crop`×`crop` window.
    Standard {
        /// Length of the shorter side after resizing.
        resize: u32,
        /// Side of the square window kept.
        crop: u32,
    },
    /// Resize the whole image to `size`×`size`, whatever its aspect ratio (no crop).
    Square {
        /// Side of the output.
        size: u32,
    },
}

/// Which part of the source image becomes the output, in source pixels, and the output's side.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    /// Left edge in the source (may be fractional).
    pub left: f64,
    /// Top edge in the source.
    pub top: f64,
    /// Width in the source.
    pub width: f64,
    /// Height in the source.
    pub height: f64,
    /// Side of the square output.
    pub out: u32,
}

impl Window {
    /// The same window on an image decoded at 1/`d` of the size.
    pub fn scaled(self, d: u32) -> Window {
        let f = f64::from(d.max(1));
        Window {
            left: self.left / f,
            top: self.top / f,
            width: self.width / f,
            height: self.height / f,
            out: self.out,
        }
    }
}

impl Transform {
    /// The standard transform for a model input of `size`: resize to `size / 0.875` (256 for
    /// 224, ImageNet's usual ratio), then crop `size`.
    pub fn standard(size: u32) -> Transform {
        Transform::Standard {
            resize: (u64::from(size) * 8 / 7) as u32,
            crop: size,
        }
    }

    /// Side of the square output.
    pub fn out_size(&self) -> u32 {
        match *self {
            Transform::Standard { crop, .. } => crop,
            Transform::Square { size } => size,
        }
    }

    /// The window of a `w`×`h` source that this transform turns into its output.
    ///
    /// For `Standard`: the resized size follows torchvision (`long = int(resize * long /
    /// short)`), and the crop's offset is `round((resized - crop) / 2)` with Python's rounding
    /// (half to even). Mapping the crop back through the resize scale gives the same output
    /// pixels as resizing the whole image and then cropping, for a filter that, like PIL's and
    /// torchvision's, reads source pixels outside the window near its edges; resizing only the
    /// window saves the work on the pixels the crop throws away. If the resized image is smaller
    /// than the crop (tiny inputs), the crop covers the whole resized image instead.
    pub fn window(&self, w: u32, h: u32) -> Window {
        match *self {
            Transform::Square { size } => Window {
                left: 0.0,
                top: 0.0,
                width: f64::from(w),
                height: f64::from(h),
                out: size,
            },
            Transform::Standard { resize, crop } => {
                let (rw, rh) = resized(w, h, resize);
                // Source pixels per resized pixel, per axis.
                let (sx, sy) = (f64::from(w) / f64::from(rw), f64::from(h) / f64::from(rh));
                let (cw, ch) = (crop.min(rw), crop.min(rh));
                let left = half_even_offset(rw - cw);
                let top = half_even_offset(rh - ch);
                Window {
                    left: f64::from(left) * sx,
                    top: f64::from(top) * sy,
                    width: f64::from(cw) * sx,
                    height: f64::from(ch) * sy,
                    out: crop,
                }
            }
        }
    }
}

/// torchvision's `Resize(short)` output size for a `w`×`h` image.
fn resized(w: u32, h: u32, short: u32) -> (u32, u32) {
    let (w64, h64, s) = (u64::from(w), u64::from(h), u64::from(short));
    if w <= h {
        (short, ((s * h64 / w64.max(1)) as u32).max(1))
    } else {
        (((s * w64 / h64.max(1)) as u32).max(1), short)
    }
}

/// `round(excess / 2)` as Python rounds: halves go to the even neighbour.
fn half_even_offset(excess: u32) -> u32 {
    let half = excess / 2;
    if excess % 2 == 1 && half % 2 == 1 {
        half + 1
    } else {
        half
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resized_size_truncates_the_long_side_like_torchvision() {
        assert_eq!(resized(500, 375, 256), (341, 256));
        assert_eq!(resized(375, 500, 256), (256, 341));
        assert_eq!(resized(500, 333, 256), (384, 256));
        assert_eq!(resized(640, 480, 256), (341, 256));
        assert_eq!(resized(300, 300, 256), (256, 256));
    }

    #[test]
    fn centre_offset_rounds_half_to_even() {
        // round(0.5) = 0, round(1.5) = 2, round(58.5) = 58, round(59.5) = 60 in Python.
        assert_eq!(half_even_offset(1), 0);
        assert_eq!(half_even_offset(3), 2);
        assert_eq!(half_even_offset(117), 58);
        assert_eq!(half_even_offset(119), 60);
        assert_eq!(half_even_offset(32), 16);
    }

    #[test]
    fn standard_window_maps_the_crop_back_to_the_source() {
        let t = Transform::standard(224);
        assert_eq!(
            t,
            Transform::Standard {
                resize: 256,
                crop: 224
            }
        );
        // 500x375 -> 341x256, crop left = round(117/2) = 58, top = 16.
        let w = t.window(500, 375);
        let (sx, sy) = (500.0 / 341.0, 375.0 / 256.0);
        assert!((w.left - 58.0 * sx).abs() < 1e-9, "{w:?}");
        assert!((w.top - 16.0 * sy).abs() < 1e-9, "{w:?}");
        assert!((w.width - 224.0 * sx).abs() < 1e-9 && (w.height - 224.0 * sy).abs() < 1e-9);
        assert_eq!(w.out, 224);
        assert!(w.left + w.width <= 500.0 && w.top + w.height <= 375.0);
    }

    #[test]
    fn tiny_and_square_inputs_stay_inside_the_image() {
        for (w, h) in [(1, 1), (7, 300), (300, 7), (224, 224), (256, 10_000)] {
            let win = Transform::standard(224).window(w, h);
            assert!(win.left >= 0.0 && win.top >= 0.0, "{w}x{h}: {win:?}");
            assert!(
                win.left + win.width <= f64::from(w) + 1e-9,
                "{w}x{h}: {win:?}"
            );
            assert!(
                win.top + win.height <= f64::from(h) + 1e-9,
                "{w}x{h}: {win:?}"
            );
            assert!(win.width > 0.0 && win.height > 0.0);
        }
        let sq = Transform::Square { size: 32 }.window(40, 30);
        assert_eq!((sq.width, sq.height, sq.out), (40.0, 30.0, 32));
    }
}
