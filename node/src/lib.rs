//! twig-node: the node daemon. One process per node owns the node store
//! (templates and snapshots), the template cache (a base template per offered VM
//! shape, each built on first need) and the warm pool of prepared `twig-vmm` processes, and
//! serves `twig.v1.Node` (for twig-controller) and `twig.node.v1.Pool` (for
//! the shims) on one ttrpc socket, `/run/twig/node.sock`. It builds app
//! templates (`EnsureTemplate`) as pods through containerd's CRI.

pub mod build;
pub mod config;
pub mod error;
pub mod gc;
pub mod lazy;
pub mod netpool;
pub mod pool;
pub mod registry;
pub mod service;
pub mod shape;
pub mod template;

pub use config::Config;
pub use error::{Error, Result};
pub use service::Daemon;

pub use twig_proto::log::log_filter;
