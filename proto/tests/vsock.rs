//! The vsock `CONNECT` client against fake VMMs on real Unix sockets: a good
//! answer, `FAILURE` and garbage answers, a VMM that hangs up, one that never
//! answers, and nobody listening; sync and async.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use twig_proto::vsock::{self, Error};

const T: Duration = Duration::from_secs(10);

/// A fake VMM: accepts one connection on `uds`, reads the request line and
/// lets `respond` answer it; returns the request line it read.
fn fake_vmm(uds: &Path, respond: impl FnOnce(UnixStream) + Send + 'static) -> JoinHandle<String> {
    let listener = UnixListener::bind(uds).unwrap();
    std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        respond(stream);
        line
    })
}

fn socket(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    dir.path().join(name)
}

#[test]
fn ok_answer_gives_the_stream_and_keeps_bytes_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let uds = socket(&dir, "ok.sock");
    let vmm = fake_vmm(&uds, |mut s| {
        // The guest's first bytes arrive right behind the answer.
        s.write_all(b"OK 1073741824\nhello").unwrap();
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
    });
    let mut stream = vsock::connect(&uds, 1024, T).unwrap();
    assert_eq!(stream.read_timeout().unwrap(), None);
    assert_eq!(stream.write_timeout().unwrap(), None);
    let mut buf = [0u8; 5];
    stream.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"hello");
    stream.write_all(b"ping").unwrap();
    assert_eq!(vmm.join().unwrap(), "CONNECT 1024\n");
}

#[test]
fn failure_and_garbage_answers_are_bad_answers() {
    let dir = tempfile::tempdir().unwrap();
    for (i, answer) in [&b"FAILURE\n"[..], b"OK\n", b"OK abc\n", &[b'x'; 100]]
        .into_iter()
        .enumerate()
    {
        let uds = socket(&dir, &format!("bad{i}.sock"));
        let vmm = fake_vmm(&uds, move |mut s| {
            s.write_all(answer).unwrap();
            // Hold the stream until the client has judged the answer.
            let _ = s.read(&mut [0u8; 1]);
        });
        let e = vsock::connect(&uds, 52, T).unwrap_err();
        let expected = String::from_utf8_lossy(answer);
        let expected = expected.trim_end_matches('\n');
        match &e {
            Error::BadAnswer { path, port, answer } => {
                assert_eq!((path, *port), (&uds, 52));
                assert!(expected.starts_with(answer.as_str()), "{answer:?}");
                assert!(!answer.is_empty());
            }
            other => panic!("{:?}: {other}", String::from_utf8_lossy(answer)),
        }
        assert!(e.to_string().contains("unexpected answer"), "{e}");
        drop(e);
        vmm.join().unwrap();
    }
}

#[test]
fn a_vmm_that_hangs_up_is_a_refusal() {
    let dir = tempfile::tempdir().unwrap();
    let uds = socket(&dir, "closed.sock");
    let vmm = fake_vmm(&uds, drop);
    let e = vsock::connect(&uds, 1024, T).unwrap_err();
    assert!(matches!(e, Error::Refused { port: 1024, .. }), "{e}");
    assert!(e.to_string().contains("listening on the port"), "{e}");
    vmm.join().unwrap();
}

#[test]
fn a_silent_vmm_times_out_within_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let uds = socket(&dir, "silent.sock");
    let (tx, rx) = mpsc::channel::<()>();
    let vmm = fake_vmm(&uds, move |s| {
        // Hold the connection open without answering until the client gave up.
        let _ = rx.recv_timeout(T);
        drop(s);
    });
    let timeout = Duration::from_millis(300);
    let t0 = Instant::now();
    let e = vsock::connect(&uds, 1024, timeout).unwrap_err();
    let took = t0.elapsed();
    assert!(took >= timeout && took < timeout * 5, "{took:?}");
    assert!(
        matches!(e, Error::Timeout { timeout: t, .. } if t == timeout),
        "{e}"
    );
    tx.send(()).unwrap();
    vmm.join().unwrap();

    // A listener that never even accepts: the request sits in the backlog.
    let uds = socket(&dir, "backlog.sock");
    let _listener = UnixListener::bind(&uds).unwrap();
    let t0 = Instant::now();
    let e = vsock::connect(&uds, 1024, timeout).unwrap_err();
    assert!(t0.elapsed() < timeout * 5, "{:?}", t0.elapsed());
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
}

#[test]
fn nobody_listening_is_a_connect_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = socket(&dir, "missing.sock");
    let e = vsock::connect(&missing, 1024, T).unwrap_err();
    assert!(
        matches!(&e, Error::Connect { path, source } if path == &missing
            && source.kind() == std::io::ErrorKind::NotFound),
        "{e}"
    );

    // A socket file whose listener is gone.
    let stale = socket(&dir, "stale.sock");
    drop(UnixListener::bind(&stale).unwrap());
    let e = vsock::connect(&stale, 1024, T).unwrap_err();
    assert!(
        matches!(&e, Error::Connect { source, .. }
            if source.kind() == std::io::ErrorKind::ConnectionRefused),
        "{e}"
    );
    assert!(e.to_string().contains("stale.sock"), "{e}");
}

#[tokio::test]
async fn async_connect_answers_like_the_sync_one() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let dir = tempfile::tempdir().unwrap();

    let uds = socket(&dir, "ok.sock");
    let vmm = fake_vmm(&uds, |mut s| {
        s.write_all(b"OK 5\nhello").unwrap();
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
    });
    let mut stream = vsock::connect_async(&uds, 1024, T).await.unwrap();
    let mut buf = [0u8; 5];
    stream.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"hello");
    stream.write_all(b"ping").await.unwrap();
    assert_eq!(vmm.join().unwrap(), "CONNECT 1024\n");

    let uds = socket(&dir, "failure.sock");
    let vmm = fake_vmm(&uds, |mut s| {
        s.write_all(b"FAILURE\n").unwrap();
        let _ = s.read(&mut [0u8; 1]);
    });
    let e = vsock::connect_async(&uds, 9, T).await.unwrap_err();
    assert!(
        matches!(&e, Error::BadAnswer { answer, port: 9, .. } if answer == "FAILURE"),
        "{e}"
    );
    drop(e);
    vmm.join().unwrap();

    let uds = socket(&dir, "closed.sock");
    let vmm = fake_vmm(&uds, drop);
    let e = vsock::connect_async(&uds, 9, T).await.unwrap_err();
    assert!(matches!(e, Error::Refused { .. }), "{e}");
    vmm.join().unwrap();

    let uds = socket(&dir, "silent.sock");
    let (tx, rx) = mpsc::channel::<()>();
    let vmm = fake_vmm(&uds, move |s| {
        let _ = rx.recv_timeout(T);
        drop(s);
    });
    let timeout = Duration::from_millis(300);
    let t0 = Instant::now();
    let e = vsock::connect_async(&uds, 9, timeout).await.unwrap_err();
    let took = t0.elapsed();
    assert!(took >= timeout && took < timeout * 5, "{took:?}");
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    tx.send(()).unwrap();
    vmm.join().unwrap();

    let e = vsock::connect_async(&socket(&dir, "missing.sock"), 9, T)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Connect { .. }), "{e}");
}
