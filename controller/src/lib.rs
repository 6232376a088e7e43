//! Twig's node controller: the `twig.dev/v1alpha1` CRDs (Snapshot, Clone,
//! Rollback, SandboxTemplate) and their reconcilers, which act on pods of
//! their own node through containerd's state and the shim's `twig` ttrpc
//! service.

pub mod context;
pub mod crd;
pub mod metrics;
pub mod pull_secrets;
pub mod reconcile;
pub mod sandbox;
pub mod shim;

pub use context::{Context, Error};
pub use reconcile::run;

pub use twig_proto::log::log_filter;
