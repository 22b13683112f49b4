//! Clients that stall, flood or send too much, against the front door over real sockets: every
//! kind of stalled connection is closed after its timeout while normal clients and the admin
//! listener are served; oversized headers get 431 and reach no engine; past the fd limit the
//! front door's newcomers replace its idle connections while the admin listener answers; idle
//! keep-alive connections close after `idle_timeout`.
//!
//! By theme: [`stalls`] (stalled connections and bodies, idle keep-alive), [`readers`] (clients
//! that stop reading, streams per address), [`headers`] (oversized and long heads) and [`fd_limit`] (floods past the fd limit, accept failures), over [`helpers`].

mod fd_limit;
mod headers;
mod helpers;
mod readers;
mod stalls;
