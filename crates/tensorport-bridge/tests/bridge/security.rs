//! Who gets in: the token, hostile streams, plaintext off loopback, mutual TLS.

use super::*;

#[test]
fn hostile_streams_are_ended_and_harm_no_one() {
    use arrow_flight::encode::FlightDataEncoderBuilder;
    use arrow_flight::FlightClient;
    use futures::{StreamExt, TryStreamExt};
    use tensorport_bridge::schema::{TensorLayout, EXTENSION_METADATA};

    let f = Fixture::new();
    let token = tensorport_bridge::auth::Token::read(&f.token()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let layout = TensorLayout::new(tensorport::DType::F32, &[3, SIZE as u64, SIZE as u64]).unwrap();
    let good = |ids: &[u64]| {
        let mut data = Vec::new();
        for &i in ids {
            data.extend(expected(i));
        }
        layout
            .batch(ids, arrow_buffer::Buffer::from_vec(data))
            .unwrap()
    };
    // Sends `batches` on one stream; returns how the gateway ended it.
    let exchange = |batches: Vec<arrow_array::RecordBatch>, with_token: bool| {
        rt.block_on(async {
            let channel = tonic::transport::Endpoint::from_shared(f.url.clone())
                .unwrap()
                .connect()
                .await
                .unwrap();
            let mut c = FlightClient::new(channel);
            if with_token {
                c.add_header("authorization", &token.bearer()).unwrap();
            }
            // Each batch with its own schema message, so a later one may change it.
            let data = futures::stream::iter(batches.into_iter().map(|b| {
                FlightDataEncoderBuilder::new()
                    .with_schema(b.schema())
                    .build(futures::stream::iter([Ok(b)]))
            }))
            .flatten();
            match c.do_exchange(data).await {
                Err(e) => Err(e.to_string()),
                Ok(s) => s.try_collect::<Vec<_>>().await.map_err(|e| e.to_string()),
            }
        })
    };
    // No token: refused before anything is read.
    let e = exchange(vec![good(&[0])], false).unwrap_err();
    assert!(e.contains("needs its token"), "{e}");
    // A shape that lies about the list's size.
    let b = good(&[0, 1]);
    let mut field = b.schema().field(1).clone();
    let mut meta = field.metadata().clone();
    meta.insert(
        EXTENSION_METADATA.to_string(),
        r#"{"shape":[3,64,64]}"#.to_string(),
    );
    field = field.with_metadata(meta);
    let lying = arrow_array::RecordBatch::try_new(
        Arc::new(arrow_schema::Schema::new(vec![
            b.schema().field(0).clone(),
            field,
        ])),
        b.columns().to_vec(),
    )
    .unwrap();
    let e = exchange(vec![lying], true).unwrap_err();
    assert!(e.contains("bad tensor shape"), "{e}");
    // The same request id twice in flight.
    let e = exchange(vec![good(&[5, 5])], true).unwrap_err();
    assert!(e.contains("already in flight"), "{e}");
    // A stream whose second batch changes the tensors' shape.
    let other = TensorLayout::new(tensorport::DType::F32, &[4]).unwrap();
    let odd = other
        .batch(&[9], arrow_buffer::Buffer::from_vec(vec![0u8; 16]))
        .unwrap();
    let e = exchange(vec![good(&[7]), odd], true).unwrap_err();
    assert!(e.contains("the stream does not decode"), "{e}");
    // A well-formed stream on the same gateway gets its answers.
    let answers = exchange(vec![good(&[1, 2, 3])], true).unwrap();
    let rows: usize = answers.iter().map(|b| b.num_rows()).sum();
    assert_eq!(rows, 3);
    // And so does a remote producer.
    run_ok(&mut f.producer("after", 32, &[]));
    assert_each_input_once(&f.lines("after"), 32);
    assert_eq!(
        f.seen.lock().unwrap().torn,
        0,
        "nothing torn reached the server"
    );
    assert_eq!(f.server.status().totals.protocol_errors, 0);
}

#[test]
fn plaintext_on_an_address_other_hosts_reach_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    run_ok(Command::new(BIN).arg("token").arg(&token));
    let out = Command::new(BIN)
        .args(["gateway", "--listen", "0.0.0.0:0", "--token-file"])
        .arg(&token)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--tls-cert") && err.contains("--allow-plaintext"),
        "{err}"
    );
    // The producer's side: its token is never sent in clear to another host, and TLS flags
    // with an http:// gateway are refused rather than ignored — before anything is sent (the
    // names below are never resolved).
    let refuse = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(["produce", "--synthetic", "1", "--token-file"])
            .arg(&token)
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = refuse(&["--gateway", "http://gateway.invalid:7450"]);
    assert!(
        err.contains("in clear") && err.contains("https://"),
        "{err}"
    );
    let err = refuse(&["--gateway", "http://127.0.0.1:7450", "--tls-ca", "ca.pem"]);
    assert!(err.contains("TLS settings"), "{err}");
}

/// A CA, a gateway certificate for `localhost` and a producer certificate signed by it, and a
/// producer certificate signed by another CA; as PEM files in `dir`.
fn pki(dir: &std::path::Path) {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, KeyUsagePurpose,
    };
    let ca = |name: &str| {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), ca.pem()).unwrap();
        ca
    };
    let leaf = |name: &str, san: &str, issuer: &CertifiedIssuer<'_, KeyPair>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![san.to_string()])
            .unwrap()
            .signed_by(&key, issuer)
            .unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
    };
    let trusted = ca("ca");
    leaf("gateway", "localhost", &trusted);
    leaf("producer", "producer", &trusted);
    let other = ca("other-ca");
    leaf("rogue", "producer", &other);
}

#[test]
fn mutual_tls_admits_only_producers_with_a_certificate_of_the_gateways_ca() {
    let certs = tempfile::tempdir().unwrap();
    pki(certs.path());
    let p = |name: &str| certs.path().join(name).to_str().unwrap().to_string();
    let f = Fixture::with_gateway_args(&[
        "--tls-cert".into(),
        p("gateway.pem"),
        "--tls-key".into(),
        p("gateway.key"),
        "--tls-client-ca".into(),
        p("ca.pem"),
    ]);
    assert!(f.url.starts_with("https://"), "{}", f.url);
    let tls = |who: &str| {
        vec![
            "--tls-ca".to_string(),
            p("ca.pem"),
            "--tls-domain".into(),
            "localhost".into(),
            "--tls-cert".into(),
            p(&format!("{who}.pem")),
            "--tls-key".into(),
            p(&format!("{who}.key")),
            "--retries".into(),
            "0".into(),
        ]
    };
    let args = tls("producer");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_ok(&mut f.producer("trusted", 40, &args));
    assert_each_input_once(&f.lines("trusted"), 40);
    // A certificate from another CA, none at all, or no TLS: refused, nothing reaches the server.
    let rogue = tls("rogue");
    let rogue: Vec<&str> = rogue.iter().map(String::as_str).collect();
    let no_cert = [
        "--tls-ca",
        &p("ca.pem"),
        "--tls-domain",
        "localhost",
        "--retries",
        "0",
    ];
    let plain_url = f.url.replacen("https://", "http://", 1);
    let plain = ["--gateway", plain_url.as_str(), "--retries", "0"];
    for (name, args) in [
        ("rogue", &rogue[..]),
        ("no-cert", &no_cert[..]),
        ("plain", &plain[..]),
    ] {
        let out = f.producer(name, 10, args).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{name} must be refused");
        assert!(f.lines(name).is_empty(), "{name} got answers");
    }
    assert_eq!(f.received("rogue").len() + f.received("no-cert").len(), 0);
    assert_eq!(
        f.server.status().totals.sessions_opened,
        1,
        "only the trusted producer's"
    );
}
