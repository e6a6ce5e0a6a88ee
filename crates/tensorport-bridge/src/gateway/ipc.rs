//! Reading a remote producer's stream of Arrow IPC messages, each looked at before it is decoded:
//! exactly one schema, which must be the tensor type's (or a NIXL stream's set-up), then record
//! batches only. Dictionary
//! batches (which a general Arrow reader absorbs and keeps, growing with every delta), a second
//! schema, tensors over the size limit and any other message end the stream; nothing a peer sends
//! is kept beyond the batch being read.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use arrow_array::RecordBatch;
use arrow_flight::FlightData;
use arrow_ipc::MessageHeader;
use arrow_schema::SchemaRef;

use crate::nixl::Hello;
use crate::schema::TensorLayout;

/// One stream's reader.
pub(crate) struct IpcReader {
    schema: Option<SchemaRef>,
    max_tensor_bytes: u64,
}

impl IpcReader {
    /// A reader that takes tensors of at most `max_tensor_bytes` each.
    pub(crate) fn new(max_tensor_bytes: u64) -> IpcReader {
        IpcReader {
            schema: None,
            max_tensor_bytes,
        }
    }

    /// The record batch `m` carries; `Ok(None)` for the schema message and for messages with no
    /// IPC header (a descriptor or application metadata only); `Err` says why the stream must
    /// end.
    pub(crate) fn read(&mut self, m: &FlightData) -> Result<Option<RecordBatch>, String> {
        if m.data_header.is_empty() {
            return Ok(None);
        }
        let msg = arrow_ipc::root_as_message(&m.data_header)
            .map_err(|e| format!("not an Arrow IPC message: {e}"))?;
        match msg.header_type() {
            MessageHeader::Schema => {
                if self.schema.is_some() {
                    return Err(
                        "a second schema on one stream (one stream, one tensor type)".into(),
                    );
                }
                let fb = msg
                    .header_as_schema()
                    .ok_or("a schema message without its schema")?;
                let schema = catch_unwind(AssertUnwindSafe(|| {
                    arrow_ipc::convert::try_fb_to_schema(fb)
                }))
                .map_err(|_| "a schema this reader cannot take".to_string())?
                .map_err(|e| e.to_string())?;
                // A NIXL stream's set-up, or else a tensor stream's layout.
                if Hello::from_schema(&schema, self.max_tensor_bytes)
                    .map_err(|e| e.to_string())?
                    .is_none()
                {
                    TensorLayout::from_schema(&schema, self.max_tensor_bytes)
                        .map_err(|e| e.to_string())?;
                }
                self.schema = Some(std::sync::Arc::new(schema));
                Ok(None)
            }
            MessageHeader::RecordBatch => {
                let schema = self
                    .schema
                    .clone()
                    .ok_or("a record batch before the stream's schema")?;
                let no_dictionaries = HashMap::new();
                catch_unwind(AssertUnwindSafe(|| {
                    arrow_flight::utils::flight_data_to_arrow_batch(m, schema, &no_dictionaries)
                }))
                .map_err(|_| "a record batch this reader cannot take".to_string())?
                .map(Some)
                .map_err(|e| e.to_string())
            }
            MessageHeader::DictionaryBatch => Err(
                "dictionary batches are not taken: a tensor stream has no dictionary fields".into(),
            ),
            other => Err(format!(
                "{other:?} messages are not taken on a tensor stream"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_flight::encode::{DictionaryHandling, FlightDataEncoderBuilder};
    use futures::TryStreamExt;
    use std::sync::Arc;

    fn encode(batches: Vec<RecordBatch>, dict: DictionaryHandling) -> Vec<FlightData> {
        let schema = batches[0].schema();
        let s = FlightDataEncoderBuilder::new()
            .with_schema(schema)
            .with_dictionary_handling(dict)
            .build(futures::stream::iter(batches.into_iter().map(Ok)));
        futures::executor::block_on(s.try_collect()).unwrap()
    }

    fn tensors(ids: &[u64]) -> RecordBatch {
        let layout = TensorLayout::new(tensorport::DType::F32, &[4]).unwrap();
        layout
            .batch(
                ids,
                arrow_buffer::Buffer::from_vec(vec![0u8; 16 * ids.len()]),
            )
            .unwrap()
    }

    #[test]
    fn a_tensor_stream_reads_and_everything_else_ends_it() {
        let mut r = IpcReader::new(1 << 20);
        let msgs = encode(
            vec![tensors(&[1, 2]), tensors(&[3])],
            DictionaryHandling::Hydrate,
        );
        let got: Vec<_> = msgs.iter().map(|m| r.read(m).unwrap()).collect();
        let rows: Vec<usize> = got.iter().flatten().map(|b| b.num_rows()).collect();
        assert_eq!(rows, vec![2, 1]);
        // A second schema.
        let again = encode(vec![tensors(&[4])], DictionaryHandling::Hydrate);
        assert!(r.read(&again[0]).unwrap_err().contains("second schema"));
        // A batch before any schema.
        let mut fresh = IpcReader::new(1 << 20);
        assert!(fresh.read(&msgs[1]).unwrap_err().contains("before"));
        // Tensors over the limit: refused at the schema.
        let mut small = IpcReader::new(8);
        assert!(small.read(&msgs[0]).is_err());
    }

    #[test]
    fn dictionaries_are_refused_at_their_first_message() {
        use arrow_array::{DictionaryArray, StringArray, UInt32Array};
        use arrow_schema::{DataType, Field, Schema};
        let values = StringArray::from(vec!["a".repeat(1 << 16)]);
        let keys = UInt32Array::from(vec![0u32; 8]);
        let dict = DictionaryArray::try_new(keys, Arc::new(values)).unwrap();
        let schema = Arc::new(Schema::new(vec![Field::new(
            "d",
            DataType::Dictionary(Box::new(DataType::UInt32), Box::new(DataType::Utf8)),
            false,
        )]));
        let b = RecordBatch::try_new(schema, vec![Arc::new(dict)]).unwrap();
        let msgs = encode(vec![b], DictionaryHandling::Resend);
        let mut r = IpcReader::new(1 << 20);
        // The schema (a dictionary field, not a tensor) is refused first.
        assert!(r.read(&msgs[0]).is_err());
        // After a valid tensor schema, a dictionary batch is refused as such.
        let mut r = IpcReader::new(1 << 20);
        let good = encode(vec![tensors(&[1])], DictionaryHandling::Hydrate);
        r.read(&good[0]).unwrap();
        let dict_msg = msgs
            .iter()
            .find(|m| {
                arrow_ipc::root_as_message(&m.data_header)
                    .is_ok_and(|x| x.header_type() == MessageHeader::DictionaryBatch)
            })
            .expect("the encoder sends a dictionary batch");
        assert!(r.read(dict_msg).unwrap_err().contains("dictionary"));
    }
}
