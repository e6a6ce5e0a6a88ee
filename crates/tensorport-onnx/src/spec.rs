//! What the server needs of a model's graph, read from the session's declared input and
//! output: one image input `[N, 3, S, S]` whose batch axis `N` is dynamic, of `f32` or `f16`;
//! a first output `[N, K]` (class scores, logits or an embedding) of `f32` or `f16`. Anything
//! else is refused with one line that names the problem.

use std::path::Path;

use ort::value::{TensorElementType, ValueType};

use crate::{Error, Result};

/// The largest model taken, its external data included: protobuf's limit for one message.
pub const MAX_MODEL_BYTES: u64 = 2 << 30;

/// An input or output element type the server hands over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    F32,
    F16,
}

impl Elem {
    pub fn name(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::F16 => "f16",
        }
    }
}

/// A model's interface as the server uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    /// The input's name.
    pub input: String,
    /// The input's element type.
    pub input_elem: Elem,
    /// The side of the square images the input takes; `None` where the graph leaves it
    /// dynamic (the caller chooses).
    pub image_size: Option<usize>,
    /// The first output's name.
    pub output: String,
    /// The first output's element type.
    pub output_elem: Elem,
    /// Scores per image: the first output's second axis.
    pub classes: usize,
}

/// One dimension as declared: `None` for a dynamic one.
fn dim(d: i64) -> Option<usize> {
    usize::try_from(d).ok().filter(|&d| d > 0)
}

fn elem(ty: TensorElementType) -> Option<Elem> {
    match ty {
        TensorElementType::Float32 => Some(Elem::F32),
        TensorElementType::Float16 => Some(Elem::F16),
        _ => None,
    }
}

/// The declared inputs and outputs, each a name and a type.
pub(crate) type Outlets<'a> = (&'a [(String, ValueType)], &'a [(String, ValueType)]);

/// Checks a graph's declared inputs and outputs against what the server needs; `path` names
/// the file in errors.
pub(crate) fn check(path: &Path, (inputs, outputs): Outlets<'_>) -> Result<ModelSpec> {
    let unfit = |why: String| Error::Unfit {
        path: path.to_owned(),
        why,
    };
    let [(input, in_ty)] = inputs else {
        let names: Vec<&str> = inputs.iter().map(|(n, _)| n.as_str()).collect();
        return Err(unfit(format!(
            "the model has {} inputs ({}); the server feeds one, a batch of images [N, 3, S, S]",
            inputs.len(),
            names.join(", ")
        )));
    };
    let ValueType::Tensor {
        ty, shape: dims, ..
    } = in_ty
    else {
        return Err(unfit(format!(
            "input {input:?} is not a tensor ({in_ty}); the server feeds a batch of images \
             [N, 3, S, S]"
        )));
    };
    let input_elem = elem(*ty).ok_or_else(|| {
        unfit(format!(
            "input {input:?} holds {ty}; the server hands over images as f32 or f16"
        ))
    })?;
    let shown = format!("{:?}", &dims[..]).replace("-1", "?");
    if dims.len() != 4 {
        return Err(unfit(format!(
            "input {input:?} has {} axes {shown}; the server feeds [N, 3, S, S] (NCHW)",
            dims.len()
        )));
    }
    if let Some(n) = dim(dims[0]) {
        return Err(unfit(format!(
            "input {input:?} {shown} takes batches of {n} only; the server needs a dynamic \
             batch axis (export with dynamic_axes={{'{input}': {{0: 'N'}}}})"
        )));
    }
    if dim(dims[1]) != Some(3) {
        return Err(unfit(format!(
            "input {input:?} {shown} does not take 3 channels first; the server feeds RGB \
             images as [N, 3, S, S]"
        )));
    }
    let image_size = match (dim(dims[2]), dim(dims[3])) {
        (Some(h), Some(w)) if h == w => Some(h),
        (None, None) => None,
        _ => {
            return Err(unfit(format!(
                "input {input:?} {shown} does not take square images (or fixes one side only); \
                 the producers make S x S images"
            )))
        }
    };
    let Some((output, out_ty)) = outputs.first() else {
        return Err(unfit("the model has no output".into()));
    };
    let ValueType::Tensor {
        ty, shape: odims, ..
    } = out_ty
    else {
        return Err(unfit(format!(
            "output {output:?} is not a tensor ({out_ty}); the server sends back [N, K] scores"
        )));
    };
    let output_elem = elem(*ty).ok_or_else(|| {
        unfit(format!(
            "output {output:?} holds {ty}; the server sends back f32 or f16 scores"
        ))
    })?;
    let oshown = format!("{:?}", &odims[..]).replace("-1", "?");
    let classes = match &odims[..] {
        [n, k] if dim(*n).is_none() => dim(*k),
        _ => None,
    };
    let Some(classes) = classes else {
        return Err(unfit(format!(
            "output {output:?} is {oshown}; the server needs [N, K]: the batch axis, then a \
             fixed number of scores per image"
        )));
    };
    Ok(ModelSpec {
        input: input.clone(),
        input_elem,
        image_size,
        output: output.clone(),
        output_elem,
        classes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ort::value::{Shape, SymbolicDimensions};

    fn tensor(ty: TensorElementType, dims: &[i64]) -> ValueType {
        ValueType::Tensor {
            ty,
            shape: Shape::new(dims.iter().copied()),
            dimension_symbols: SymbolicDimensions::empty(dims.len()),
        }
    }

    fn spec(inputs: &[(&str, ValueType)], outputs: &[(&str, ValueType)]) -> Result<ModelSpec> {
        let own = |v: &[(&str, ValueType)]| -> Vec<(String, ValueType)> {
            v.iter().map(|(n, t)| (n.to_string(), t.clone())).collect()
        };
        check(Path::new("m.onnx"), (&own(inputs), &own(outputs)))
    }

    const F32: TensorElementType = TensorElementType::Float32;

    #[test]
    fn an_image_classifier_fits_and_its_sizes_are_read() {
        let s = spec(
            &[("x", tensor(F32, &[-1, 3, 224, 224]))],
            &[("y", tensor(F32, &[-1, 1000]))],
        )
        .unwrap();
        assert_eq!(s.image_size, Some(224));
        assert_eq!(
            (s.classes, s.input_elem, s.output_elem),
            (1000, Elem::F32, Elem::F32)
        );
        // f16, dynamic sides, a second output (the first one counts).
        let s = spec(
            &[("x", tensor(TensorElementType::Float16, &[-1, 3, -1, -1]))],
            &[
                ("emb", tensor(TensorElementType::Float16, &[-1, 512])),
                ("aux", tensor(F32, &[-1, 3])),
            ],
        )
        .unwrap();
        assert_eq!((s.image_size, s.classes), (None, 512));
        assert_eq!((s.input_elem, s.output_elem), (Elem::F16, Elem::F16));
    }

    #[test]
    fn every_unfit_graph_is_refused_with_its_reason() {
        let out = [("y", tensor(F32, &[-1, 10]))];
        let img = ("x", tensor(F32, &[-1, 3, 32, 32]));
        type Outlets<'a> = Vec<(&'a str, ValueType)>;
        let cases: Vec<(Outlets, Outlets, &str)> = vec![
            (vec![], out.to_vec(), "0 inputs"),
            (vec![img.clone(), img.clone()], out.to_vec(), "2 inputs"),
            (
                vec![("x", tensor(TensorElementType::Int64, &[-1, 3, 32, 32]))],
                out.to_vec(),
                "holds i64",
            ),
            (
                vec![("x", tensor(F32, &[-1, 3, 32]))],
                out.to_vec(),
                "3 axes",
            ),
            (
                vec![("x", tensor(F32, &[8, 3, 32, 32]))],
                out.to_vec(),
                "batches of 8 only",
            ),
            (
                vec![("x", tensor(F32, &[-1, 32, 32, 3]))],
                out.to_vec(),
                "3 channels first",
            ),
            (
                vec![("x", tensor(F32, &[-1, 3, 32, 48]))],
                out.to_vec(),
                "square",
            ),
            (vec![img.clone()], vec![], "no output"),
            (
                vec![img.clone()],
                vec![("y", tensor(F32, &[-1, 10, 2]))],
                "needs [N, K]",
            ),
            (
                vec![img.clone()],
                vec![("y", tensor(F32, &[-1, -1]))],
                "needs [N, K]",
            ),
            (
                vec![img.clone()],
                vec![("y", tensor(TensorElementType::Int64, &[-1, 10]))],
                "holds i64",
            ),
        ];
        for (inputs, outputs, want) in cases {
            let e = spec(&inputs, &outputs).unwrap_err().to_string();
            assert!(e.starts_with("m.onnx: ") && e.contains(want), "{want}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }
}
