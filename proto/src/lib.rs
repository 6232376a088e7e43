//! twig-proto: Twig's protocols in one place.
//!
//! - [`agent`] — messages of `agent.proto` (package `twig.agent.v1`, service
//!   `Agent`): the host ↔ guest-agent protocol, spoken over vsock.
//! - [`twig`] — messages of `twig.proto` (package `twig.v1`, services `Twig`
//!   and `Node`): what the controller asks of the shim and the node daemon.
//! - `agent_ttrpc` (feature `sync`) — sync `AgentClient`, `Agent` server
//!   trait and `create_agent`.
//! - `agent_ttrpc_async` (feature `async`) — the same for tokio.
//! - [`node`] — messages of `node.proto` (package `twig.node.v1`, service
//!   `Pool`): what a shim asks of its node daemon (a prepared VMM).
//! - `node_ttrpc` (feature `sync`) — sync `PoolClient` (the shim's).
//! - `node_ttrpc_async` (feature `async`) — async `Pool` server trait and
//!   `create_pool` (the node daemon's).
//! - `twig_ttrpc` (feature `async`) — async `TwigClient`/`NodeClient`,
//!   `Twig`/`Node` server traits, `create_twig`/`create_node`.
//! - [`contract`] — what crosses crates: pod annotations (restore-from,
//!   template, CRI's pod namespace, egress policy), snapshot labels, and
//!   the services' error codes with their meaning.
//! - [`vsock`] — the host side of the Firecracker-style `CONNECT <port>`
//!   handshake on a VMM's vsock Unix socket (async variant with `async`).
//!
//! Without features the crate holds only the messages and the sync vsock
//! client (dependencies: protobuf, thiserror).

/// Messages generated from `agent.proto`.
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod agent {
    include!(concat!(env!("OUT_DIR"), "/sync/agent.rs"));
}

/// Messages generated from `twig.proto`.
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod twig {
    include!(concat!(env!("OUT_DIR"), "/sync/twig.rs"));
}

/// Messages generated from `node.proto`.
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod node {
    include!(concat!(env!("OUT_DIR"), "/sync/node.rs"));
}

/// Sync ttrpc client, server trait and registration helper of service
/// `Pool`.
#[cfg(feature = "sync")]
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod node_ttrpc {
    include!(concat!(env!("OUT_DIR"), "/sync/node_ttrpc.rs"));
}

/// Async (tokio) ttrpc client, server trait and registration helper of
/// service `Pool`.
#[cfg(feature = "async")]
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod node_ttrpc_async {
    include!(concat!(env!("OUT_DIR"), "/async/node_ttrpc.rs"));
}

/// Sync ttrpc client, server trait and registration helper of service
/// `Agent`.
#[cfg(feature = "sync")]
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod agent_ttrpc {
    include!(concat!(env!("OUT_DIR"), "/sync/agent_ttrpc.rs"));
}

/// Async (tokio) ttrpc client, server trait and registration helper of
/// service `Agent`.
#[cfg(feature = "async")]
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod agent_ttrpc_async {
    include!(concat!(env!("OUT_DIR"), "/async/agent_ttrpc.rs"));
}

/// Async (tokio) ttrpc clients, server traits and registration helpers of
/// services `Twig` and `Node`.
#[cfg(feature = "async")]
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod twig_ttrpc {
    include!(concat!(env!("OUT_DIR"), "/async/twig_ttrpc.rs"));
}

pub mod contract;
#[cfg(feature = "log")]
pub mod log;
pub mod vsock;

/// The vsock port the guest agent listens on.
pub const AGENT_VSOCK_PORT: u32 = 1024;

/// The vsock port of the guest agent's port-forward listener (`kubectl
/// port-forward`): per connection the host sends a [`port_forward`]
/// request naming a TCP port, the agent connects to it on the guest's
/// loopback and answers one status; then the stream carries that
/// connection's bytes both ways (a `shutdown(SHUT_WR)` on either side
/// reaches the other).
pub const FORWARD_VSOCK_PORT: u32 = 1025;

/// The vsock port of the guest agent's file-share listener: per connection
/// the host sends a [`file_share::Request`] naming the share; the agent
/// keeps the stream until a `PrepareVolume` names that share and hands it
/// to the guest kernel as the transport of a 9P2000.L mount (`trans=fd`);
/// the host serves the volume's directory on its end (twig-shim).
pub const FILE_SHARE_VSOCK_PORT: u32 = 1026;

/// The request that opens a file-share connection on
/// [`FILE_SHARE_VSOCK_PORT`]: fixed-size, no answer.
pub mod file_share {
    /// The request: `TWFS` and the share's id.
    pub const REQUEST_LEN: usize = 4 + ID_LEN;
    /// A share's id: lower-case hex digits.
    pub const ID_LEN: usize = 32;
    const MAGIC: &[u8; 4] = b"TWFS";

    /// Whether `id` is a well-formed share id.
    pub fn valid_id(id: &str) -> bool {
        id.len() == ID_LEN && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    }

    /// The request's bytes for share `id`; `None` if `id` is malformed.
    pub fn encode(id: &str) -> Option<[u8; REQUEST_LEN]> {
        if !valid_id(id) {
            return None;
        }
        let mut out = [0u8; REQUEST_LEN];
        out[..4].copy_from_slice(MAGIC);
        out[4..].copy_from_slice(id.as_bytes());
        Some(out)
    }

    /// The share id of a request; `None` for anything malformed.
    pub fn decode(bytes: &[u8; REQUEST_LEN]) -> Option<String> {
        if &bytes[..4] != MAGIC {
            return None;
        }
        let id = std::str::from_utf8(&bytes[4..]).ok()?;
        valid_id(id).then(|| id.to_string())
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn requests_round_trip_and_malformed_ones_are_refused() {
            let id = "0123456789abcdef0123456789abcdef";
            let bytes = encode(id).unwrap();
            assert_eq!(decode(&bytes).as_deref(), Some(id));
            assert!(encode("short").is_none());
            assert!(encode(&"G".repeat(ID_LEN)).is_none());
            let mut bad = bytes;
            bad[0] = b'X';
            assert!(decode(&bad).is_none());
            let mut bad = bytes;
            bad[10] = b'/';
            assert!(decode(&bad).is_none());
        }
    }
}

/// The request and answer that open a port-forward connection on
/// [`FORWARD_VSOCK_PORT`], both fixed-size.
pub mod port_forward {
    /// The request: `TWPF`, the family asked first (4 or 6; the agent
    /// tries the other if that is refused), a zero byte, the port (big
    /// endian).
    pub const REQUEST_LEN: usize = 8;
    /// The answer: a status, a zero byte, an errno (big endian, 0 unless
    /// the status is [`Status::Failed`]).
    pub const ANSWER_LEN: usize = 4;
    const MAGIC: &[u8; 4] = b"TWPF";

    /// What the host asks for.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Request {
        /// The guest's TCP port.
        pub port: u16,
        /// `::1` first rather than 127.0.0.1.
        pub ipv6: bool,
    }

    impl Request {
        /// The request's bytes.
        pub fn encode(&self) -> [u8; REQUEST_LEN] {
            let p = self.port.to_be_bytes();
            let family = if self.ipv6 { 6 } else { 4 };
            [
                MAGIC[0], MAGIC[1], MAGIC[2], MAGIC[3], family, 0, p[0], p[1],
            ]
        }

        /// A request from its bytes; `None` for anything malformed (the
        /// magic, the family, the zero byte, port 0).
        pub fn decode(bytes: &[u8; REQUEST_LEN]) -> Option<Request> {
            if &bytes[..4] != MAGIC || bytes[5] != 0 {
                return None;
            }
            let ipv6 = match bytes[4] {
                4 => false,
                6 => true,
                _ => return None,
            };
            let port = u16::from_be_bytes([bytes[6], bytes[7]]);
            (port != 0).then_some(Request { port, ipv6 })
        }
    }

    /// The agent's answer.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Status {
        /// Connected: the bytes follow.
        Ok,
        /// Connecting failed on both families; the errno of the first.
        Failed(u16),
        /// The request was malformed.
        BadRequest,
        /// Too many port-forward connections at once.
        Busy,
    }

    impl Status {
        /// The answer's bytes.
        pub fn encode(&self) -> [u8; ANSWER_LEN] {
            let (code, errno) = match *self {
                Status::Ok => (0, 0),
                Status::Failed(errno) => (1, errno),
                Status::BadRequest => (2, 0),
                Status::Busy => (3, 0),
            };
            let e = errno.to_be_bytes();
            [code, 0, e[0], e[1]]
        }

        /// An answer from its bytes; `None` for an unknown one.
        pub fn decode(bytes: &[u8; ANSWER_LEN]) -> Option<Status> {
            let errno = u16::from_be_bytes([bytes[2], bytes[3]]);
            match (bytes[0], bytes[1]) {
                (0, 0) => Some(Status::Ok),
                (1, 0) => Some(Status::Failed(errno)),
                (2, 0) => Some(Status::BadRequest),
                (3, 0) => Some(Status::Busy),
                _ => None,
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn requests_and_answers_round_trip_and_garbage_is_refused() {
            for r in [
                Request {
                    port: 1,
                    ipv6: false,
                },
                Request {
                    port: 65535,
                    ipv6: true,
                },
            ] {
                assert_eq!(Request::decode(&r.encode()), Some(r));
            }
            assert_eq!(Request::decode(b"TWPF\x04\x00\x00\x00"), None, "port 0");
            assert_eq!(Request::decode(b"TWPF\x05\x00\x00\x50"), None, "family");
            assert_eq!(Request::decode(b"GET / HT"), None);
            for s in [
                Status::Ok,
                Status::Failed(111),
                Status::BadRequest,
                Status::Busy,
            ] {
                assert_eq!(Status::decode(&s.encode()), Some(s));
            }
            assert_eq!(Status::decode(&[9, 0, 0, 0]), None);
        }
    }
}

/// Where the guest agent keeps guest volumes (PrepareVolume): volume
/// `<name>` is the directory `<GUEST_VOLUMES_DIR>/<name>` in the VM, on a
/// tmpfs of the agent's (root only), or a tmpfs of its own. A container
/// gets a volume, or one file of it, by a bind mount whose source in its
/// OCI spec is `<GUEST_VOLUMES_DIR>/<name>[/<path>]`.
pub const GUEST_VOLUMES_DIR: &str = "/run/twig/volumes";
