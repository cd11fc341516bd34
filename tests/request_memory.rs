//! A guest's request body costs the host about its size, however it is framed: 1 MiB sent
//! as one-byte chunks was collected as a million frames, each pinning a piece of hyper's
//! read buffer (~40 MiB of host memory per call, four calls in flight per turn). Alone in
//! its test binary: it reads the process's peak resident memory (`VmHWM`), which no other
//! test may move meanwhile.

use roundtable_sandbox::internals::testing::{broker_policy, start_broker, BrokerTurn};
use roundtable_sandbox::Speaker;
use roundtable_sandbox_test_support::model::{ScriptedModel, Step};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The process's peak resident memory so far, in KiB.
fn peak_kib() -> u64 {
    roundtable_sandbox_test_support::process::status_kib("VmHWM")
}

#[tokio::test]
async fn a_body_of_one_byte_chunks_costs_about_its_size() {
    let model = ScriptedModel::start(vec![Step::text("ok")]).await;
    let broker = start_broker(broker_policy(&model.url(), "sk-test-memory")).await;
    let turn = BrokerTurn::start(&broker, "#memory", Speaker::default()).await;
    let content = "x".repeat(1_000_000);
    let body = format!(r#"{{"messages":[{{"role":"user","content":"{content}"}}]}}"#);
    // The framing, written before the peak is read: 6 MB of `1\r\nX\r\n`.
    let mut wire = Vec::with_capacity(body.len() * 6 + 256);
    wire.extend_from_slice(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: broker\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n",
    );
    for b in body.bytes() {
        wire.extend_from_slice(b"1\r\n");
        wire.push(b);
        wire.extend_from_slice(b"\r\n");
    }
    wire.extend_from_slice(b"0\r\n\r\n");
    drop(body);
    drop(content);
    let before = peak_kib();
    let mut socket = tokio::net::UnixStream::connect(&turn.socket).await.unwrap();
    let (mut read, mut write) = socket.split();
    let send = async {
        write.write_all(&wire).await.unwrap();
    };
    let mut answer = Vec::new();
    let receive = read.read_to_end(&mut answer);
    let (_, received) = tokio::join!(send, receive);
    received.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(model.requests().len(), 1);
    // The body once in the broker, once parsed and once forwarded: a few MiB. Collected
    // frame by frame it was ~40 MiB.
    let grown = peak_kib().saturating_sub(before);
    assert!(grown < 16 * 1024, "the host's peak grew by {grown} KiB");
    eprintln!("a 1 MB body in one-byte chunks: the host's peak grew by {grown} KiB");
}
