//! The log filter of the programs that carry secrets over ttrpc
//! (twig-controller and twig-node: `EnsureTemplateRequest.pull_credentials`):
//! ttrpc's own logging capped below the level at which it logs messages.

/// What ttrpc may log at most: at `trace` the ttrpc crate logs every
/// message it reads or writes (`ttrpc::asynchronous::connection`, raw
/// payload bytes included), and `EnsureTemplate` carries registry logins,
/// which are never logged.
pub const TTRPC_LOG_CAPS: [&str; 2] = ["ttrpc=debug", "ttrpc::asynchronous::connection=debug"];

/// The log filter of `spec` (`RUST_LOG`'s syntax; none or invalid:
/// `info`), ttrpc capped by [`TTRPC_LOG_CAPS`] whatever `spec` says.
pub fn log_filter(spec: Option<&str>) -> tracing_subscriber::EnvFilter {
    use tracing_subscriber::EnvFilter;
    let filter = spec
        .and_then(|s| EnvFilter::try_new(s).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    TTRPC_LOG_CAPS
        .iter()
        .filter_map(|d| d.parse().ok())
        .fold(filter, EnvFilter::add_directive)
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl Write for Buffer {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// What reaches the log under `spec` of a trace line of ttrpc's
    /// connection and of another target.
    fn logged(spec: &str) -> String {
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(super::log_filter(Some(spec)))
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::trace!(target: "ttrpc::asynchronous::connection", "write message: LOGIN");
            tracing::trace!(target: "ttrpc", "ttrpc says LOGIN");
            tracing::trace!(target: "twig::other", "other line");
        });
        let out = buffer.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        String::from_utf8_lossy(&out).into_owned()
    }

    #[test]
    fn ttrpc_never_logs_its_messages_whatever_rust_log_says() {
        for spec in [
            "trace",
            "ttrpc=trace",
            "ttrpc::asynchronous::connection=trace",
            "info,ttrpc::asynchronous=trace",
        ] {
            let out = logged(spec);
            assert!(!out.contains("LOGIN"), "{spec}: {out}");
        }
        assert!(logged("trace").contains("other line"));
        assert!(super::log_filter(None).to_string().contains("info"));
    }
}
