//! This node's store usage in `/metrics`: every `store_refresh` the node
//! daemon's `GetStoreUsage` answer replaces the `twig_node_store_*` gauges
//! of this node. When the daemon does not answer, the series are dropped
//! (no stale numbers; alert on their absence) and a warning is logged once
//! per outage.

use std::sync::Arc;

use tokio::time::MissedTickBehavior;

use crate::context::Context;

/// Refreshes the store gauges of this node until the future is dropped.
pub(crate) async fn run(ctx: Arc<Context>) {
    let mut tick = tokio::time::interval(ctx.store_refresh);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tick.tick().await;
        match ctx.node.store_usage().await {
            Ok(usage) => {
                if failing {
                    tracing::info!("the node daemon reports its store usage again");
                }
                failing = false;
                ctx.metrics.set_store_usage(&ctx.node_name, &usage);
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "reading the node store's usage failed; its metrics are dropped until it answers");
                }
                failing = true;
                ctx.metrics.remove_store_usage(&ctx.node_name);
            }
        }
    }
}
