//! The schema's unit tests: layouts, rows, results, and the bounds they enforce.

use super::*;

fn f32_bytes(v: &[f32]) -> Buffer {
    let mut b = arrow_buffer::MutableBuffer::new(v.len() * 4);
    for x in v {
        b.extend_from_slice(&x.to_ne_bytes());
    }
    b.into()
}

#[test]
fn a_batch_reads_back_row_by_row() {
    let l = TensorLayout::new(DType::F32, &[2, 3]).unwrap();
    let vals: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let b = l.batch(&[7, 9], f32_bytes(&vals)).unwrap();
    let back = TensorLayout::from_schema(&b.schema(), 1 << 20).unwrap();
    assert_eq!(back, l);
    let rows = TensorRows::new(&back, &b).unwrap();
    assert_eq!(rows.len(), 2);
    let (id, bytes) = rows.get(1);
    assert_eq!(id, 9);
    assert_eq!(bytes, f32_bytes(&vals[6..]).as_slice());
}

#[test]
fn a_sliced_batch_gives_its_own_rows() {
    let l = TensorLayout::new(DType::U8, &[4]).unwrap();
    let b = l
        .batch(&[1, 2, 3], Buffer::from_vec((0u8..12).collect::<Vec<_>>()))
        .unwrap();
    let s = b.slice(1, 2);
    let rows = TensorRows::new(&l, &s).unwrap();
    assert_eq!(rows.get(0), (2, &[4u8, 5, 6, 7][..]));
    assert_eq!(rows.get(1), (3, &[8u8, 9, 10, 11][..]));
}

#[test]
fn schemas_that_are_not_tensor_streams_are_refused() {
    let l = TensorLayout::new(DType::F32, &[3, 4]).unwrap();
    let good = l.schema();
    // Too large for the gateway.
    assert!(matches!(
        TensorLayout::from_schema(&good, 47),
        Err(SchemaError::TooLarge { bytes: 48, .. })
    ));
    // A shape that disagrees with the list size.
    let mut f = good.field(1).clone();
    let mut m = f.metadata().clone();
    m.insert(
        EXTENSION_METADATA.to_string(),
        r#"{"shape":[5,5]}"#.to_string(),
    );
    f = f.with_metadata(m);
    let lying = Schema::new(vec![good.field(0).clone(), f.clone()]);
    assert!(matches!(
        TensorLayout::from_schema(&lying, 1 << 20),
        Err(SchemaError::Shape(_))
    ));
    // Not the extension type.
    let plain = Schema::new(vec![
        good.field(0).clone(),
        good.field(1).clone().with_metadata(HashMap::new()),
    ]);
    assert!(matches!(
        TensorLayout::from_schema(&plain, 1 << 20),
        Err(SchemaError::Schema(_))
    ));
    // Metadata that is not JSON, a permutation, too many dims, a bad id type.
    for meta in [
        "not json",
        r#"{"shape":[4,3],"permutation":[1,0]}"#,
        r#"{"shape":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,12]}"#,
    ] {
        let mut m = good.field(1).metadata().clone();
        m.insert(EXTENSION_METADATA.to_string(), meta.to_string());
        let s = Schema::new(vec![
            good.field(0).clone(),
            good.field(1).clone().with_metadata(m),
        ]);
        assert!(TensorLayout::from_schema(&s, 1 << 20).is_err(), "{meta}");
    }
    let bad_id = Schema::new(vec![
        Field::new(ID, DataType::Int64, false),
        good.field(1).clone(),
    ]);
    assert!(TensorLayout::from_schema(&bad_id, 1 << 20).is_err());
    // Element types without a dtype.
    let utf = Field::new(
        TENSOR,
        DataType::FixedSizeList(Arc::new(Field::new("item", DataType::Utf8, false)), 12),
        false,
    )
    .with_metadata(good.field(1).metadata().clone());
    let s = Schema::new(vec![good.field(0).clone(), utf]);
    assert!(matches!(
        TensorLayout::from_schema(&s, 1 << 20),
        Err(SchemaError::DType(_))
    ));
}

#[test]
fn layouts_without_elements_or_beyond_the_limits_are_refused() {
    assert!(TensorLayout::new(DType::F32, &[]).is_err());
    assert!(TensorLayout::new(DType::F32, &[3, 0]).is_err());
    assert!(TensorLayout::new(DType::F32, &[u64::MAX, 2]).is_err());
    assert!(TensorLayout::new(DType::F32, &[1 << 31]).is_err());
    assert!(TensorLayout::new(DType::BF16, &[4]).is_err());
    let l = TensorLayout::new(DType::I64, &[2, 2]).unwrap();
    assert_eq!((l.elements(), l.bytes()), (4, 32));
    assert!(l.batch(&[1], Buffer::from_vec(vec![0u8; 31])).is_err());
}

#[test]
fn a_batch_whose_tensors_do_not_match_the_stream_is_refused() {
    let l = TensorLayout::new(DType::U8, &[4]).unwrap();
    let other = TensorLayout::new(DType::U8, &[2]).unwrap();
    let b = other
        .batch(&[1, 2], Buffer::from_vec(vec![0u8; 4]))
        .unwrap();
    assert!(TensorRows::new(&l, &b).is_err());
}

#[test]
fn results_round_trip() {
    let rows = vec![
        ResultRow {
            id: 3,
            outcome: Ok(vec![1, 2, 3]),
        },
        ResultRow {
            id: 4,
            outcome: Err((20, "the model failed".into())),
        },
        ResultRow {
            id: 5,
            outcome: Ok(vec![]),
        },
    ];
    assert_eq!(read_results(&results_batch(&rows)).unwrap(), rows);
}
