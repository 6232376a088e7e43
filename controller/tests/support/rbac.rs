//! What the controller calls on the API server: the chart's ClusterRole must
//! grant exactly this, and the reconciler tests check the controller stays within it.

/// (API group, resource, verbs).
pub const CONTROLLER_RULES: &[(&str, &str, &[&str])] = &[];
