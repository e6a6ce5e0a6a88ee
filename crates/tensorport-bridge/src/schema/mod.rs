//! The bridge's format on Arrow Flight: what a remote producer sends on a `DoExchange` stream,
//! and what the gateway answers. Both are Arrow record batches (docs/scale-out.md has the
//! tables):
//!
//! - **Tensors** (remote producer → gateway): `id: UInt64` (the request id, the producer's own)
//!   and `tensor: FixedSizeList<T, n>`, a column of Arrow's canonical `arrow.fixed_shape_tensor`
//!   extension type, whose metadata `{"shape": [...]}` gives every row's shape. One stream
//!   carries one dtype and one shape, fixed by its schema.
//! - **Results** (gateway → remote producer): `id: UInt64`, `result: Binary` (the server's
//!   result bytes), and for a failed request `code: UInt16` (the protocol's error code) and
//!   `error: Utf8`.
//!
//! Everything a peer sends is untrusted: [`TensorLayout::from_schema`] and [`TensorRows::new`]
//! accept a schema and a batch only after checking every field, type, length and bound, and
//! hand out byte slices only inside what they checked.

use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{UInt16Type, UInt64Type};
use arrow_array::{
    make_array, Array, ArrayRef, BinaryArray, FixedSizeListArray, RecordBatch, StringArray,
    UInt16Array, UInt64Array,
};
use arrow_buffer::Buffer;
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};
use tensorport::wire::MAX_DIMS;
use tensorport::DType;

/// The field metadata key that names an Arrow extension type.
pub const EXTENSION_NAME: &str = "ARROW:extension:name";
/// The field metadata key of an extension type's parameters.
pub const EXTENSION_METADATA: &str = "ARROW:extension:metadata";
/// Arrow's canonical extension type for a column of tensors of one shape.
pub const FIXED_SHAPE_TENSOR: &str = "arrow.fixed_shape_tensor";
/// The request id column.
pub const ID: &str = "id";
/// The tensor column.
pub const TENSOR: &str = "tensor";
/// Longest extension metadata read (a shape of [`MAX_DIMS`] dimensions needs far less).
const MAX_METADATA: usize = 4096;

/// Why a peer's schema or batch was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum SchemaError {
    /// The schema does not have the bridge's columns.
    #[error("the stream's schema is not a tensor batch: {0}")]
    Schema(String),
    /// The tensors' element type has no tensorport dtype (or the dtype no Arrow type).
    #[error("unsupported element type {0}; send f32, f16, f64, u8, i8, i32 or i64 tensors")]
    DType(String),
    /// The shape is missing, malformed, too large or does not match the column.
    #[error("bad tensor shape: {0}")]
    Shape(String),
    /// One tensor is larger than the gateway takes.
    #[error("a tensor of {bytes} bytes is over the gateway's limit of {limit} bytes per tensor")]
    TooLarge {
        /// The tensor's bytes.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
    /// A batch's columns do not hold what the schema says.
    #[error("malformed batch: {0}")]
    Batch(String),
}

impl From<ArrowError> for SchemaError {
    fn from(e: ArrowError) -> SchemaError {
        SchemaError::Batch(e.to_string())
    }
}

/// The Arrow element type of a dtype, where Arrow has one.
pub fn arrow_type(d: DType) -> Option<DataType> {
    Some(match d {
        DType::F32 => DataType::Float32,
        DType::F16 => DataType::Float16,
        DType::F64 => DataType::Float64,
        DType::U8 => DataType::UInt8,
        DType::I8 => DataType::Int8,
        DType::I32 => DataType::Int32,
        DType::I64 => DataType::Int64,
        DType::BF16 => return None,
    })
}

/// The dtype of an Arrow element type, where tensorport has one.
pub fn dtype_of(t: &DataType) -> Option<DType> {
    Some(match t {
        DataType::Float32 => DType::F32,
        DataType::Float16 => DType::F16,
        DataType::Float64 => DType::F64,
        DataType::UInt8 => DType::U8,
        DataType::Int8 => DType::I8,
        DataType::Int32 => DType::I32,
        DataType::Int64 => DType::I64,
        _ => return None,
    })
}

/// The parameters of `arrow.fixed_shape_tensor`.
#[derive(serde::Serialize, serde::Deserialize)]
struct TensorMeta {
    shape: Vec<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dim_names: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    permutation: Option<Vec<u64>>,
}

/// The dtype and shape every tensor of one stream has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLayout {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first (row-major).
    pub shape: Vec<u64>,
    elements: usize,
    bytes: usize,
}

impl TensorLayout {
    /// A layout, if it has an Arrow type, 1 to [`MAX_DIMS`] dimensions and at least one element
    /// whose count and bytes fit in memory.
    pub fn new(dtype: DType, shape: &[u64]) -> Result<TensorLayout, SchemaError> {
        if arrow_type(dtype).is_none() {
            return Err(SchemaError::DType(format!("{dtype:?}")));
        }
        if shape.is_empty() || shape.len() > MAX_DIMS {
            return Err(SchemaError::Shape(format!(
                "{} dimensions; a tensor has 1 to {MAX_DIMS}",
                shape.len()
            )));
        }
        let elements = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n > 0 && n <= i32::MAX as u64)
            .ok_or_else(|| {
                SchemaError::Shape(format!(
                    "{shape:?} has no elements or more than {} (Arrow's list size)",
                    i32::MAX
                ))
            })?;
        let bytes = elements
            .checked_mul(dtype.size())
            .filter(|&b| b <= usize::MAX as u64)
            .ok_or_else(|| SchemaError::Shape(format!("{shape:?} overflows")))?;
        Ok(TensorLayout {
            dtype,
            shape: shape.to_vec(),
            elements: elements as usize,
            bytes: bytes as usize,
        })
    }

    /// Elements per tensor.
    pub fn elements(&self) -> usize {
        self.elements
    }

    /// Bytes per tensor.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    fn element_type(&self) -> DataType {
        arrow_type(self.dtype).expect("checked in new")
    }

    fn list_type(&self) -> DataType {
        DataType::FixedSizeList(
            Arc::new(Field::new("item", self.element_type(), false)),
            self.elements as i32,
        )
    }

    /// The schema of a stream of these tensors.
    pub fn schema(&self) -> SchemaRef {
        let meta = serde_json::to_string(&TensorMeta {
            shape: self.shape.clone(),
            dim_names: None,
            permutation: None,
        })
        .expect("serialisable");
        let tensor = Field::new(TENSOR, self.list_type(), false).with_metadata(HashMap::from([
            (EXTENSION_NAME.to_string(), FIXED_SHAPE_TENSOR.to_string()),
            (EXTENSION_METADATA.to_string(), meta),
        ]));
        Arc::new(Schema::new(vec![
            Field::new(ID, DataType::UInt64, false),
            tensor,
        ]))
    }

    /// The layout a peer's schema declares, if it is a tensor stream whose tensors are at most
    /// `max_bytes` each.
    pub fn from_schema(schema: &Schema, max_bytes: u64) -> Result<TensorLayout, SchemaError> {
        let fields = schema.fields();
        if fields.len() != 2 || fields[0].name() != ID || fields[1].name() != TENSOR {
            let names: Vec<&str> = fields.iter().map(|f| f.name().as_str()).collect();
            return Err(SchemaError::Schema(format!(
                "columns {names:?}, expected [\"{ID}\", \"{TENSOR}\"]"
            )));
        }
        if fields[0].data_type() != &DataType::UInt64 {
            return Err(SchemaError::Schema(format!(
                "\"{ID}\" is {}, expected UInt64",
                fields[0].data_type()
            )));
        }
        let tensor = &fields[1];
        let meta = tensor.metadata();
        if meta.get(EXTENSION_NAME).map(String::as_str) != Some(FIXED_SHAPE_TENSOR) {
            return Err(SchemaError::Schema(format!(
                "\"{TENSOR}\" is not of the {FIXED_SHAPE_TENSOR} extension type"
            )));
        }
        let raw = meta
            .get(EXTENSION_METADATA)
            .ok_or_else(|| SchemaError::Shape("no extension metadata".into()))?;
        if raw.len() > MAX_METADATA {
            return Err(SchemaError::Shape(format!(
                "extension metadata of {} bytes (at most {MAX_METADATA})",
                raw.len()
            )));
        }
        let parsed: TensorMeta = serde_json::from_str(raw)
            .map_err(|e| SchemaError::Shape(format!("extension metadata {raw:?}: {e}")))?;
        if let Some(p) = &parsed.permutation {
            if !p.iter().enumerate().all(|(i, &d)| d == i as u64) || p.len() != parsed.shape.len() {
                return Err(SchemaError::Shape(format!(
                    "permutation {p:?}: only row-major tensors are taken"
                )));
            }
        }
        let DataType::FixedSizeList(item, n) = tensor.data_type() else {
            return Err(SchemaError::Schema(format!(
                "\"{TENSOR}\" is {}, expected a FixedSizeList",
                tensor.data_type()
            )));
        };
        let dtype = dtype_of(item.data_type())
            .ok_or_else(|| SchemaError::DType(item.data_type().to_string()))?;
        let list_bytes = dtype.size().saturating_mul((*n).max(0) as u64);
        if list_bytes > max_bytes {
            return Err(SchemaError::TooLarge {
                bytes: list_bytes,
                limit: max_bytes,
            });
        }
        let layout = TensorLayout::new(dtype, &parsed.shape)?;
        if layout.elements as i64 != i64::from(*n) {
            return Err(SchemaError::Shape(format!(
                "shape {:?} holds {} elements, the list {n}",
                parsed.shape, layout.elements
            )));
        }
        Ok(layout)
    }

    /// A batch of `ids.len()` tensors whose bytes lie one after another in `data` (row-major,
    /// native byte order, as in a pool slot).
    pub fn batch(&self, ids: &[u64], data: Buffer) -> Result<RecordBatch, SchemaError> {
        if Some(data.len()) != ids.len().checked_mul(self.bytes) {
            return Err(SchemaError::Batch(format!(
                "{} bytes for {} tensors of {} bytes",
                data.len(),
                ids.len(),
                self.bytes
            )));
        }
        let values = arrow_data::ArrayData::try_new(
            self.element_type(),
            ids.len() * self.elements,
            None,
            0,
            vec![data],
            vec![],
        )?;
        let list = FixedSizeListArray::try_new(
            Arc::new(Field::new("item", self.element_type(), false)),
            self.elements as i32,
            make_array(values),
            None,
        )?;
        let columns: Vec<ArrayRef> =
            vec![Arc::new(UInt64Array::from(ids.to_vec())), Arc::new(list)];
        Ok(RecordBatch::try_new(self.schema(), columns)?)
    }
}

/// The tensors of one received batch, checked against the stream's layout.
#[derive(Debug)]
pub struct TensorRows<'a> {
    ids: &'a [u64],
    /// Exactly the rows' bytes (a shared view of the batch's buffer).
    data: Buffer,
    bytes: usize,
}

impl<'a> TensorRows<'a> {
    /// The rows of `batch`, if its columns are the layout's, hold no nulls, and its tensor bytes
    /// are all there.
    pub fn new(
        layout: &TensorLayout,
        batch: &'a RecordBatch,
    ) -> Result<TensorRows<'a>, SchemaError> {
        if batch.num_columns() != 2 {
            return Err(SchemaError::Batch(format!(
                "{} columns",
                batch.num_columns()
            )));
        }
        let ids = batch
            .column(0)
            .as_primitive_opt::<UInt64Type>()
            .ok_or_else(|| SchemaError::Batch(format!("\"{ID}\" is not UInt64")))?;
        let list = batch
            .column(1)
            .as_fixed_size_list_opt()
            .ok_or_else(|| SchemaError::Batch(format!("\"{TENSOR}\" is not a FixedSizeList")))?;
        if ids.null_count() > 0 || list.null_count() > 0 || list.values().null_count() > 0 {
            return Err(SchemaError::Batch("null ids or tensors".into()));
        }
        if list.value_length() as i64 != layout.elements as i64
            || list.values().data_type() != &layout.element_type()
        {
            return Err(SchemaError::Batch(format!(
                "tensors of {} × {}, the stream's schema says {} × {}",
                list.value_length(),
                list.values().data_type(),
                layout.elements,
                layout.element_type()
            )));
        }
        let rows = batch.num_rows();
        let values = list.values().to_data();
        let width = layout.dtype.size() as usize;
        let want = rows
            .checked_mul(layout.bytes)
            .ok_or_else(|| SchemaError::Batch("too many rows".into()))?;
        // The rows' values: the child from its offset on (a sliced list slices its child).
        let start = values
            .offset()
            .checked_mul(width)
            .ok_or_else(|| SchemaError::Batch("offset overflows".into()))?;
        let data = values
            .buffers()
            .first()
            .filter(|b| start.checked_add(want).is_some_and(|end| end <= b.len()))
            .map(|b| b.slice_with_length(start, want))
            .ok_or_else(|| {
                SchemaError::Batch(format!(
                    "{rows} tensors of {} bytes are not all in the batch's buffer",
                    layout.bytes
                ))
            })?;
        if ids.len() != rows {
            return Err(SchemaError::Batch("ids and tensors differ in count".into()));
        }
        Ok(TensorRows {
            ids: ids.values(),
            data,
            bytes: layout.bytes,
        })
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Tensor `i`'s request id and bytes.
    pub fn get(&self, i: usize) -> (u64, &[u8]) {
        (
            self.ids[i],
            &self.data.as_slice()[i * self.bytes..(i + 1) * self.bytes],
        )
    }
}

/// One request's answer, as the gateway sends it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultRow {
    /// The request id the producer gave.
    pub id: u64,
    /// The result bytes, or the protocol's error code and the server's explanation.
    pub outcome: Result<Vec<u8>, (u16, String)>,
}

/// The schema of the gateway's answers.
pub fn results_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new(ID, DataType::UInt64, false),
        Field::new("result", DataType::Binary, true),
        Field::new("code", DataType::UInt16, true),
        Field::new("error", DataType::Utf8, true),
    ]))
}

/// A batch of answers.
pub fn results_batch(rows: &[ResultRow]) -> RecordBatch {
    let ids = UInt64Array::from_iter_values(rows.iter().map(|r| r.id));
    let result = BinaryArray::from_iter(rows.iter().map(|r| r.outcome.as_ref().ok()));
    let code = UInt16Array::from_iter(rows.iter().map(|r| r.outcome.as_ref().err().map(|e| e.0)));
    let error = StringArray::from_iter(rows.iter().map(|r| r.outcome.as_ref().err().map(|e| &e.1)));
    RecordBatch::try_new(
        results_schema(),
        vec![
            Arc::new(ids),
            Arc::new(result),
            Arc::new(code),
            Arc::new(error),
        ],
    )
    .expect("columns match the schema")
}

/// The answers in a batch from the gateway.
pub fn read_results(batch: &RecordBatch) -> Result<Vec<ResultRow>, SchemaError> {
    let bad = |what: &str| SchemaError::Batch(format!("results: {what}"));
    if batch.num_columns() != 4 {
        return Err(bad("not 4 columns"));
    }
    let ids = batch
        .column(0)
        .as_primitive_opt::<UInt64Type>()
        .ok_or_else(|| bad("id is not UInt64"))?;
    let result = batch
        .column(1)
        .as_binary_opt::<i32>()
        .ok_or_else(|| bad("result is not Binary"))?;
    let code = batch
        .column(2)
        .as_primitive_opt::<UInt16Type>()
        .ok_or_else(|| bad("code is not UInt16"))?;
    let error = batch
        .column(3)
        .as_string_opt::<i32>()
        .ok_or_else(|| bad("error is not Utf8"))?;
    if ids.null_count() > 0 {
        return Err(bad("null ids"));
    }
    (0..batch.num_rows())
        .map(|i| {
            let outcome = if result.is_valid(i) {
                Ok(result.value(i).to_vec())
            } else if code.is_valid(i) {
                let why = if error.is_valid(i) {
                    error.value(i)
                } else {
                    ""
                };
                Err((code.value(i), why.to_string()))
            } else {
                return Err(bad("a row with neither a result nor an error"));
            };
            Ok(ResultRow {
                id: ids.value(i),
                outcome,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
