//! What the gRPC front door tests share: a vLLM or SGLang engine whose rank 3 has the least KV,
//! behind a router.

use rankgate::app::Router;
use rankgate_sim::sim::SimFlavor as Flavor;

use crate::common::grpc::*;
use crate::common::*;

/// One engine of ranks 2 and 3 reporting KV 0.8 and 0.1, behind rankgate, both ranks available
/// with those numbers: rank 3 is the pick.
pub async fn low_kv_on_rank_3(flavor: Flavor) -> (Eng, Router) {
    let e = Eng::start(flavor, 2, 2).await;
    e.sim.set_kv_usage(vec![0.8, 0.1]);
    let r = grpc_router(&[&e]).await;
    wait_state(&r, &[0, 1], "available").await;
    wait_kv(&r, &[(0, 0.8), (1, 0.1)]).await;
    (e, r)
}
