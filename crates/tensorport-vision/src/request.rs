//! An image request as a server takes it: [`check_shape`] (a contiguous `[C, H, W]` tensor of
//! `f32`, normalised, or `u8`, the planes before normalising), [`check_image`] (the same, its
//! elements in a host slot, as [`Pixels`]), and [`normaliser`], the ImageNet table the
//! producers normalise with and the server normalises `u8` planes with. The server's batchers
//! and `tensorport-dfdx`'s `stack_images` share them.

use tensorport::{DType, Request};

use crate::Normaliser;

/// Why a request is not an image the model takes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("request {request_id} from {producer}: {problem}")]
pub struct Misfit {
    /// The request.
    pub request_id: u64,
    /// Its producer's name.
    pub producer: String,
    /// What is wrong.
    pub problem: String,
}

impl Misfit {
    fn of(req: &Request, problem: String) -> Misfit {
        Misfit {
            request_id: req.request_id(),
            producer: req.producer().to_string(),
            problem,
        }
    }
}

/// Checks that `req` describes a contiguous tensor of exactly `shape` (wherever it is): `f32`,
/// normalised, or `u8`, the 8-bit planes before normalising (the server normalises them with
/// the ImageNet table, to the same floats). Returns the dtype.
pub fn check_shape(req: &Request, shape: [usize; 3]) -> Result<DType, Misfit> {
    let d = req.desc();
    if d.dtype() != DType::F32 && d.dtype() != DType::U8 {
        return Err(Misfit::of(
            req,
            format!(
                "dtype {} (the model takes f32, or u8 pixels it normalises)",
                d.dtype().name()
            ),
        ));
    }
    let want: Vec<u64> = shape.iter().map(|&x| x as u64).collect();
    if d.shape() != want.as_slice() {
        return Err(Misfit::of(
            req,
            format!(
                "shape {:?} (the model takes {:?}; match the server's image size)",
                d.shape(),
                shape
            ),
        ));
    }
    if !d.is_contiguous() {
        return Err(Misfit::of(
            req,
            "not contiguous (the model takes row-major images)".into(),
        ));
    }
    Ok(d.dtype())
}

/// An image's elements in a host slot.
#[derive(Debug, Clone, Copy)]
pub enum Pixels<'a> {
    /// Normalised floats.
    F32(&'a [f32]),
    /// 8-bit planes, to normalise.
    U8(&'a [u8]),
}

impl Pixels<'_> {
    /// Appends the image's normalised floats to `out`.
    pub fn extend_normalised(&self, out: &mut Vec<f32>) {
        match *self {
            Pixels::F32(px) => out.extend_from_slice(px),
            Pixels::U8(px) => {
                let start = out.len();
                out.resize(start + px.len(), 0.0);
                normaliser().normalise_planes(px, px.len() / 3, &mut out[start..]);
            }
        }
    }
}

/// The ImageNet table the producers normalise with, made once.
pub fn normaliser() -> &'static Normaliser {
    static N: std::sync::OnceLock<Normaliser> = std::sync::OnceLock::new();
    N.get_or_init(Normaliser::imagenet)
}

/// Checks that `req` is a contiguous image of exactly `shape` in a host slot (see
/// [`check_shape`]), and returns its elements.
pub fn check_image(req: &Request, shape: [usize; 3]) -> Result<Pixels<'_>, Misfit> {
    let dtype = check_shape(req, shape)?;
    let not_host = || {
        Misfit::of(
            req,
            "not in a host slot (a device tensor needs the CUDA server)".into(),
        )
    };
    Ok(match dtype {
        DType::U8 => Pixels::U8(req.as_slice::<u8>().ok_or_else(not_host)?),
        _ => Pixels::F32(req.as_slice::<f32>().ok_or_else(not_host)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tensorport::{Producer, ProducerConfig, Server, ServerConfig, TensorSpec};

    /// Requests through a real server: f32 and u8 images taken, each misfit named.
    #[test]
    fn images_are_taken_and_each_misfit_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s.sock");
        let server = Server::bind(ServerConfig::new(&sock)).unwrap();
        let mut p = Producer::connect(&sock, ProducerConfig::new("cam")).unwrap();
        let shape = [3usize, 2, 2];
        let floats: Vec<f32> = (0..12).map(|k| k as f32 - 6.0).collect();
        let planes: Vec<u8> = (0..12).map(|k| k * 20).collect();
        let mut send = |bytes: &[u8], spec: TensorSpec| {
            let mut l = p.lease(Duration::from_secs(2)).unwrap();
            l.write_pod(0, bytes);
            l.submit(&spec).unwrap();
        };
        let as_bytes: Vec<u8> = floats.iter().flat_map(|f| f.to_ne_bytes()).collect();
        send(&as_bytes, TensorSpec::new(DType::F32, &[3, 2, 2]));
        send(&planes, TensorSpec::new(DType::U8, &[3, 2, 2]));
        send(&[0u8; 48], TensorSpec::new(DType::I32, &[3, 2, 2]));
        send(&as_bytes[..36], TensorSpec::new(DType::F32, &[3, 3, 1]));
        send(
            &as_bytes,
            TensorSpec::new(DType::F32, &[3, 2, 2]).with_strides(&[1, 6, 3]),
        );
        let mut reqs = Vec::new();
        while reqs.len() < 5 {
            reqs.extend(
                server
                    .recv_batch(5, Duration::from_secs(2), Duration::from_millis(50))
                    .unwrap(),
            );
        }
        reqs.sort_by_key(|r| r.request_id());
        match check_image(&reqs[0], shape).unwrap() {
            Pixels::F32(px) => assert_eq!(px, &floats[..]),
            Pixels::U8(_) => panic!("an f32 image read as u8"),
        }
        let mut out = Vec::new();
        check_image(&reqs[1], shape)
            .unwrap()
            .extend_normalised(&mut out);
        let mut want = vec![0f32; 12];
        normaliser().normalise_planes(&planes, 4, &mut want);
        assert_eq!(out, want);
        let why = |k: usize| check_shape(&reqs[k], shape).unwrap_err();
        assert!(why(2).problem.starts_with("dtype i32"), "{}", why(2));
        assert!(why(3).problem.starts_with("shape [3, 3, 1]"), "{}", why(3));
        assert!(why(4).problem.starts_with("not contiguous"), "{}", why(4));
        assert_eq!(why(2).producer, "cam");
        assert!(why(2)
            .to_string()
            .starts_with(&format!("request {} from cam: ", reqs[2].request_id())));
    }
}
