//! A fast hasher for the search's maps, whose keys are small integers and layout sets.
//!
//! The standard library's SipHash resists hash flooding, which these maps never meet
//! (their keys come from the search itself, not from outside), and it took about a third
//! of a search's time (Llama-7B's overlapped search on paper-8: hashing the held
//! layouts of every new state and the memo keys of every dominance check). These maps
//! use rustc's own hasher (`rustc-hash`, FxHash) instead. Iteration order is never read
//! from them, so the hasher changes no result.

/// A `HashMap` hashed by `rustc-hash`'s `FxHasher`.
pub type FastMap<K, V> = rustc_hash::FxHashMap<K, V>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_finds_what_it_holds() {
        let mut map: FastMap<(u32, Box<[u16]>), usize> = FastMap::default();
        for i in 0..1000u32 {
            map.insert((i % 7, vec![i as u16, (i * 3) as u16].into_boxed_slice()), i as usize);
        }
        assert_eq!(map.len(), 1000);
        for i in 0..1000u32 {
            assert_eq!(map.get(&(i % 7, vec![i as u16, (i * 3) as u16].into_boxed_slice())), Some(&(i as usize)));
        }
    }
}
