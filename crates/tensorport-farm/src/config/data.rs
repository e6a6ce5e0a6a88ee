//! Configurations as data: the one JSON document a farm hands each child (`tensorport serve
//! --config-data`, `tensorport produce --config-data`) in place of flags, and the forms of the
//! other crates' types in it (each by its name, as the command line spells it).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{ProduceConfig, ServeConfig};
use crate::error::ConfigError;

impl ProduceConfig {
    /// This configuration as one JSON document ([`ProduceConfig::from_data`] reads it back).
    pub fn to_data(&self) -> String {
        serde_json::to_string(self).expect("a configuration serialises")
    }

    /// A configuration from [`ProduceConfig::to_data`]'s document: every field known, each
    /// within its bounds ([`ProduceConfig::check`], as for flags).
    pub fn from_data(data: &str) -> Result<ProduceConfig, ConfigError> {
        let c: ProduceConfig = decode(data)?;
        c.check()?;
        Ok(c)
    }
}

impl ServeConfig {
    /// This configuration as one JSON document ([`ServeConfig::from_data`] reads it back).
    pub fn to_data(&self) -> String {
        serde_json::to_string(self).expect("a configuration serialises")
    }

    /// A configuration from [`ServeConfig::to_data`]'s document: every field known, each within
    /// its bounds ([`ServeConfig::check`], as for flags).
    pub fn from_data(data: &str) -> Result<ServeConfig, ConfigError> {
        let c: ServeConfig = decode(data)?;
        c.check()?;
        Ok(c)
    }
}

/// `true`, for fields a document may leave out.
pub(super) fn yes() -> bool {
    true
}

/// A document read as `T`, every field known; not checked.
fn decode<T: serde::de::DeserializeOwned>(data: &str) -> Result<T, ConfigError> {
    serde_json::from_str(data).map_err(|e| ConfigError::Data(e.to_string()))
}

/// A path as the OS has it: a string where it is UTF-8, else its bytes (a list of numbers), so
/// every name a file can have round-trips.
pub(super) mod path {
    use super::*;
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    use std::path::{Path, PathBuf};

    #[derive(Serialize, Deserialize)]
    #[serde(untagged)]
    pub(super) enum Form<'a> {
        Text(std::borrow::Cow<'a, str>),
        Bytes(Vec<u8>),
    }

    pub(super) fn form(p: &Path) -> Form<'_> {
        match p.to_str() {
            Some(s) => Form::Text(s.into()),
            None => Form::Bytes(p.as_os_str().as_bytes().to_vec()),
        }
    }

    pub(super) fn from_form(f: Form<'_>) -> PathBuf {
        match f {
            Form::Text(s) => PathBuf::from(s.into_owned()),
            Form::Bytes(b) => PathBuf::from(std::ffi::OsString::from_vec(b)),
        }
    }

    pub fn serialize<S: Serializer>(p: &Path, s: S) -> Result<S::Ok, S::Error> {
        form(p).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<PathBuf, D::Error> {
        Form::deserialize(d).map(from_form)
    }
}

/// `Option<PathBuf>` as [`path`] writes a path, or null.
pub(super) mod opt_path {
    use super::*;
    use std::path::PathBuf;

    pub fn serialize<S: Serializer>(p: &Option<PathBuf>, s: S) -> Result<S::Ok, S::Error> {
        p.as_deref().map(path::form).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PathBuf>, D::Error> {
        Ok(Option::<path::Form>::deserialize(d)?.map(path::from_form))
    }
}

/// `tensorport_dfdx::ModelConfig` as `{"image_size", "classes", "width"}`.
pub(super) mod model_config {
    use super::*;
    use tensorport_dfdx::ModelConfig;

    #[derive(Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Form {
        image_size: usize,
        classes: usize,
        width: usize,
    }

    pub fn serialize<S: Serializer>(c: &ModelConfig, s: S) -> Result<S::Ok, S::Error> {
        Form {
            image_size: c.image_size,
            classes: c.classes,
            width: c.width,
        }
        .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ModelConfig, D::Error> {
        let f = Form::deserialize(d)?;
        Ok(ModelConfig {
            image_size: f.image_size,
            classes: f.classes,
            width: f.width,
        })
    }
}

/// A value by its name, parsed back with `parse`.
fn by_name<'de, D: Deserializer<'de>, T>(
    d: D,
    parse: impl Fn(&str) -> Option<T>,
    what: &str,
) -> Result<T, D::Error> {
    let name = String::deserialize(d)?;
    parse(&name).ok_or_else(|| serde::de::Error::custom(format!("{name:?} is not a {what}")))
}

/// `Option<tensorport_cudnn::Precision>` by name (`"f32"`, `"bf16"`, …), or null.
pub(super) mod precision {
    use super::*;
    use tensorport_cudnn::Precision;

    pub fn serialize<S: Serializer>(p: &Option<Precision>, s: S) -> Result<S::Ok, S::Error> {
        p.map(|p| p.name()).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Precision>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(None),
            Some(name) => Precision::from_name(&name)
                .map(Some)
                .ok_or_else(|| serde::de::Error::custom(format!("{name:?} is not a precision"))),
        }
    }
}

/// `tensorport_vision::JpegDecoder` by name.
pub(super) mod jpeg_decoder {
    use super::*;
    use tensorport_vision::JpegDecoder;

    pub fn serialize<S: Serializer>(j: &JpegDecoder, s: S) -> Result<S::Ok, S::Error> {
        j.name().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<JpegDecoder, D::Error> {
        let all = [JpegDecoder::LibjpegTurbo, JpegDecoder::ZuneJpeg];
        by_name(
            d,
            |n| all.into_iter().find(|j| j.name() == n),
            "JPEG decoder",
        )
    }
}

/// `tensorport_nvjpeg::GpuDecode` by name.
pub(super) mod gpu_decode {
    use super::*;
    use tensorport_nvjpeg::GpuDecode;

    pub fn serialize<S: Serializer>(g: &GpuDecode, s: S) -> Result<S::Ok, S::Error> {
        g.name().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<GpuDecode, D::Error> {
        by_name(d, GpuDecode::parse, "GPU decoding")
    }
}

/// `tensorport_nvjpeg::Upsampling` by name.
pub(super) mod upsampling {
    use super::*;
    use tensorport_nvjpeg::Upsampling;

    pub fn serialize<S: Serializer>(u: &Upsampling, s: S) -> Result<S::Ok, S::Error> {
        u.name().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Upsampling, D::Error> {
        by_name(d, Upsampling::parse, "chroma upsampling")
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use super::super::*;
    use super::decode;
    use crate::record::Keep;

    /// A producer's configuration with every field away from its default.
    fn producer() -> ProduceConfig {
        ProduceConfig {
            socket: PathBuf::from("/run/x/tp.sock"),
            inputs: Inputs::Synthetic(77),
            output: Output::File(PathBuf::from("/tmp/out.jsonl")),
            image_size: 96,
            in_flight: 12,
            ready: true,
            prep: PrepOptions {
                transform: TransformKind::Square,
                jpeg_decoder: tensorport_vision::JpegDecoder::ZuneJpeg,
                max_pixels: 12_345_678,
                dct_scaling: true,
                coarse_progressive: false,
                pixels: Pixels::U8,
                gpu_upsampling: tensorport_nvjpeg::Upsampling::parse("replicate")
                    .expect("an upsampling"),
                gpu_decode: tensorport_nvjpeg::GpuDecode::ByChroma,
            },
            profile: true,
            keep: Keep::Top(5),
            non_finite: crate::record::NonFinite::Error,
            name: "producer-7".into(),
            timeout: Duration::from_millis(12_345),
            spin: Duration::from_micros(33),
            read_timeout: Duration::from_millis(2_500),
            wait_for_server: Duration::from_millis(4_321),
            gpu: Some(GpuPrep {
                ordinal: 3,
                batch: 48,
                cpu_threads: 6,
            }),
        }
    }

    /// A server's configuration with every field away from its default.
    fn server() -> ServeConfig {
        ServeConfig {
            socket: PathBuf::from("/run/x/tp-1.sock"),
            model: ModelOptions {
                kind: ModelKind::Onnx(PathBuf::from("/models/r50.onnx")),
                config: tensorport_dfdx::ModelConfig {
                    image_size: 160,
                    classes: 1000,
                    width: 24,
                },
                weights: Some(PathBuf::from("/w.safetensors")),
                seed: 9,
                device: Device::Cuda(2),
                max_batch: 77,
                max_wait: Duration::from_micros(1_500),
                precision: Some(tensorport_cudnn::Precision::Bf16),
                ort_provider: OrtProvider::Tensorrt,
                tf32: false,
            },
            slots: 17,
            slot_size: Some(1 << 20),
            max_sessions: 9,
            memory_budget: Some(3 << 30),
            max_session_memory: Some(1 << 30),
            threads: Some(5),
            spin: Duration::from_micros(7),
            metrics: Some("127.0.0.1:0".into()),
            workers: 3,
            sink: true,
            fence_timeout: Duration::from_millis(4_321),
        }
    }

    #[test]
    fn every_field_of_a_producers_configuration_round_trips() {
        let p = producer();
        assert_ne!(
            tensorport_nvjpeg::Upsampling::default(),
            p.prep.gpu_upsampling
        );
        assert_ne!(tensorport_nvjpeg::GpuDecode::default(), p.prep.gpu_decode);
        let back = decode::<ProduceConfig>(&p.to_data()).unwrap();
        assert_eq!(back, p);
        // The other inputs and outputs too.
        for (inputs, output) in [
            (Inputs::Worklist, Output::Stdout),
            (Inputs::Dir(PathBuf::from("/photos")), Output::Stdout),
        ] {
            let q = ProduceConfig {
                inputs,
                output,
                gpu: None,
                keep: Keep::All,
                ..producer()
            };
            assert_eq!(decode::<ProduceConfig>(&q.to_data()).unwrap(), q);
        }
    }

    #[test]
    fn every_field_of_a_servers_configuration_round_trips() {
        let s = server();
        assert_eq!(decode::<ServeConfig>(&s.to_data()).unwrap(), s);
        for kind in [ModelKind::Classifier, ModelKind::None] {
            let mut t = server();
            t.model.kind = kind;
            t.model.precision = None;
            t.model.device = Device::Cpu;
            assert_eq!(decode::<ServeConfig>(&t.to_data()).unwrap(), t);
        }
    }

    #[test]
    fn paths_that_are_not_utf8_round_trip() {
        use std::os::unix::ffi::OsStringExt;
        let odd = |tail: &[u8]| {
            let mut b = b"/tmp/x\n".to_vec();
            b.extend_from_slice(tail);
            PathBuf::from(std::ffi::OsString::from_vec(b))
        };
        let p = ProduceConfig {
            socket: odd(b"\xff.sock"),
            inputs: Inputs::Dir(odd(b"\xfe")),
            output: Output::File(odd(b"\x80.jsonl")),
            ..producer()
        };
        assert_eq!(decode::<ProduceConfig>(&p.to_data()).unwrap(), p);
        let mut s = server();
        s.socket = odd(b"\xc3");
        s.model.kind = ModelKind::Onnx(odd(b"\xff.onnx"));
        s.model.weights = Some(odd(b"\xfa.safetensors"));
        assert_eq!(decode::<ServeConfig>(&s.to_data()).unwrap(), s);
    }

    #[test]
    fn a_document_that_is_not_a_configuration_is_refused_with_why() {
        let e = decode::<ServeConfig>("{\"socket\": 3}").unwrap_err();
        assert!(matches!(e, ConfigError::Data(_)), "{e}");
        let bad = producer()
            .to_data()
            .replace("\"zune-jpeg\"", "\"no-such-decoder\"");
        let e = decode::<ProduceConfig>(&bad).unwrap_err();
        assert!(e.to_string().contains("no-such-decoder"), "{e}");
    }

    /// A consistent producer and server, as a farm hands its children.
    fn sound() -> (ProduceConfig, ServeConfig) {
        let p = ProduceConfig {
            gpu: None,
            ..producer()
        };
        let s = ServeConfig::new("/run/x/tp.sock", ModelOptions::default());
        (p, s)
    }

    #[test]
    fn documents_pass_the_checks_flags_pass_and_name_no_unknown_field() {
        let (p, s) = sound();
        assert_eq!(ProduceConfig::from_data(&p.to_data()).unwrap(), p);
        assert_eq!(ServeConfig::from_data(&s.to_data()).unwrap(), s);
        // A field the configuration does not have, at the top and inside.
        let extra = p.to_data().replacen('{', "{\"slotz\":3,", 1);
        let e = ProduceConfig::from_data(&extra).unwrap_err().to_string();
        assert!(e.contains("unknown field `slotz`"), "{e}");
        let extra = s.to_data().replace("\"seed\":", "\"sead\":1,\"seed\":");
        let e = ServeConfig::from_data(&extra).unwrap_err().to_string();
        assert!(e.contains("unknown field `sead`"), "{e}");
        let extra = s.to_data().replace("\"width\":", "\"depth\":1,\"width\":");
        assert!(ServeConfig::from_data(&extra).is_err());
        // Values out of bounds: each refused with its field named, none panics later.
        let huge = "{\"secs\":18446744073709551615,\"nanos\":999999999}";
        // The document with the value at `pointer` (a JSON pointer) replaced.
        let at = |doc: String, pointer: &str, value: &str| {
            let mut v: serde_json::Value = serde_json::from_str(&doc).unwrap();
            *v.pointer_mut(pointer).unwrap() = serde_json::from_str(value).unwrap();
            v.to_string()
        };
        for (field, value, want) in [
            ("/timeout", huge, "timeout"),
            ("/read_timeout", huge, "read_timeout"),
            ("/spin", huge, "spin"),
            ("/in_flight", "0", "in_flight 0"),
            ("/image_size", "1099511627776", "image size"),
            ("/image_size", "0", "image size"),
            ("/prep/max_pixels", "0", "max_pixels 0"),
        ] {
            let e = ProduceConfig::from_data(&at(p.to_data(), field, value))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{field}={value}: {e}");
        }
        for (field, value, want) in [
            ("/model/max_wait", huge, "max_wait"),
            ("/fence_timeout", huge, "fence_timeout"),
            ("/slots", "0", "slots 0"),
            ("/workers", "0", "workers 0"),
            ("/max_sessions", "0", "max_sessions 0"),
            ("/model/config/image_size", "1099511627776", "image size"),
            ("/model/max_batch", "0", "largest batch"),
        ] {
            let e = ServeConfig::from_data(&at(s.to_data(), field, value))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{field}={value}: {e}");
        }
    }

    proptest::proptest! {
        /// Any number in any numeric field of a sound document: the document is refused, or
        /// every duration it holds can be added to now (nothing past it panics).
        #[test]
        fn any_number_anywhere_is_refused_or_safe(
            k in 0usize..64,
            secs in proptest::prelude::any::<u64>(),
            n in proptest::prelude::any::<u64>(),
        ) {
            let (p, s) = sound();
            for doc in [p.to_data(), s.to_data()] {
                let mut v: serde_json::Value = serde_json::from_str(&doc).unwrap();
                let mut numbers = Vec::new();
                fn walk(v: &serde_json::Value, at: String, out: &mut Vec<String>) {
                    match v {
                        serde_json::Value::Number(_) => out.push(at),
                        serde_json::Value::Object(m) => {
                            for (key, x) in m {
                                walk(x, format!("{at}/{key}"), out)
                            }
                        }
                        serde_json::Value::Array(a) => {
                            for (i, x) in a.iter().enumerate() {
                                walk(x, format!("{at}/{i}"), out)
                            }
                        }
                        _ => {}
                    }
                }
                walk(&v, String::new(), &mut numbers);
                let at = &numbers[k % numbers.len()];
                let value = if at.ends_with("/secs") { secs } else { n };
                *v.pointer_mut(at).unwrap() = value.into();
                let now = std::time::Instant::now();
                let text = v.to_string();
                if let Ok(c) = ProduceConfig::from_data(&text) {
                    for d in [c.timeout, c.spin, c.read_timeout] {
                        proptest::prop_assert!(now.checked_add(d).is_some());
                    }
                }
                if let Ok(c) = ServeConfig::from_data(&text) {
                    for d in [c.spin, c.fence_timeout, c.model.max_wait] {
                        proptest::prop_assert!(now.checked_add(d).is_some());
                    }
                }
            }
        }
    }
}
