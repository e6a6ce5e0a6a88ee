//! The smallest tensorport program: a server and one producer process.
//!
//! `cargo run --example minimal` starts a server here and runs itself again as the producer. The
//! producer writes ten tensors into its shared pool; the server sums each one in place (no copy)
//! and sends the sum back.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tensorport::{DType, Producer, ProducerConfig, Server, ServerConfig, TensorSpec};

fn producer(socket: &Path) -> Result<(), tensorport::Error> {
    let mut p = Producer::connect(socket, ProducerConfig::new("minimal-producer"))?;
    for i in 0..10u32 {
        let mut lease = p.lease(Duration::from_secs(5))?; // a slot of our pool, ours alone
        lease.write_pod(0, &vec![i as f32; 32 * 32]); // write the tensor in place
        let id = lease.submit(&TensorSpec::new(DType::F32, &[32, 32]))?; // now the server's
        let done = p.recv_result(Duration::from_secs(5))?;
        let bytes = done.result.expect("the server answers every request");
        let sum = f32::from_le_bytes(bytes[..4].try_into().unwrap());
        println!("request {id}: sum of a 32x32 tensor of {i}s = {sum}");
    }
    p.close()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("producer") {
        return Ok(producer(Path::new(&args[2]))?);
    }
    if let Some(a) = args.get(1) {
        eprintln!("usage: minimal (no arguments)\nunexpected argument '{a}'");
        std::process::exit(2);
    }
    let dir = std::env::temp_dir().join(format!("tensorport-minimal-{}", std::process::id()));
    let socket = dir.join("tp.sock");
    let server = Server::bind(ServerConfig::new(&socket))?;
    let mut child = Command::new(std::env::current_exe()?)
        .arg("producer")
        .arg(&socket)
        .spawn()?;
    for _ in 0..10 {
        let req = server
            .recv_timeout(Duration::from_secs(10))?
            .expect("the producer sends ten tensors");
        let sum: f32 = req.as_slice::<f32>().expect("contiguous f32").iter().sum();
        req.respond(&sum.to_le_bytes())?; // releases the slot and answers
    }
    let status = child.wait()?;
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "producer failed");
    Ok(())
}
