//! The metrics server survives a failed `accept`: the process runs out of
//! file descriptors while a scrape waits, and the scrape is answered once
//! descriptors are free again. Alone in its test binary, because it
//! exhausts the process's descriptors.

use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use twig_controller::metrics::{serve, Metrics};

/// Log lines, shared with the tracing subscriber.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(
            &self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
        .into_owned()
    }
}

/// EMFILE: the process has no free file descriptor.
const EMFILE: i32 = 24;

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn metrics_server_keeps_serving_after_accept_fails() {
    let logs = Logs::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    runtime.spawn(serve(listener, Arc::new(Metrics::new())));

    // The process runs out of descriptors; one is freed for the client's socket,
    // so the server has none left to accept the connection with.
    let mut hog = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => hog.push(f),
            Err(e) if e.raw_os_error() == Some(EMFILE) => break,
            Err(e) => panic!("opening /dev/null: {e}"),
        }
        assert!(hog.len() < 1 << 20, "no descriptor limit to reach");
    }
    hog.pop();
    let mut scrape = std::net::TcpStream::connect(addr).expect("connect");
    scrape
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    scrape
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("request");
    wait_until("the server to fail an accept", || {
        logs.text()
            .contains("accepting a metrics connection failed; going on")
    });
    assert!(
        logs.text().contains("Too many open files"),
        "{}",
        logs.text()
    );

    // Descriptors are free again: the waiting scrape is served, and so is a new one.
    drop(hog);
    let mut response = String::new();
    scrape.read_to_string(&mut response).expect("response");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with("ok\n"), "{response}");
    let mut again = std::net::TcpStream::connect(addr).expect("connect again");
    again
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("request");
    let mut response = String::new();
    again.read_to_string(&mut response).expect("response");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
}
