//! A fast hasher for the search's maps, whose keys are small integers and layout sets.
//!
//! The standard library's SipHash resists hash flooding, which these maps never meet
//! (their keys come from the search itself, not from outside), and it took about a third
//! of a search's time (Llama-7B's overlapped search on paper-8: hashing the held
//! layouts of every new state and the memo keys of every dominance check). This is the
//! multiply-rotate hash rustc uses for its own tables (FxHash), written here rather than
//! taken as a dependency for twenty lines; `finish` rotates the product so that its
//! best-mixed high bits reach the low bits a table indexes by. Iteration order is never
//! read from these maps, so the hasher changes no result.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The multiplier (FxHash's 64-bit constant, from the golden ratio).
const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

/// FxHash's state: each word folded in by rotate, xor and multiply.
#[derive(Debug, Clone, Copy, Default)]
pub struct FastHasher {
    hash: u64,
}

impl FastHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word) ^ ((rest.len() as u64) << 56));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u16(&mut self, i: u16) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.hash.rotate_left(26)
    }
}

/// Builds [`FastHasher`]s (stateless: every map hashes alike).
pub type FastBuild = BuildHasherDefault<FastHasher>;

/// A `HashMap` with [`FastHasher`].
pub type FastMap<K, V> = HashMap<K, V, FastBuild>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{BuildHasher, Hash};

    fn hash_of<T: Hash + ?Sized>(value: &T) -> u64 {
        FastBuild::default().hash_one(value)
    }

    #[test]
    fn equal_keys_hash_alike_and_near_keys_apart() {
        assert_eq!(hash_of(&(3u32, 5u16, 9u16)), hash_of(&(3u32, 5u16, 9u16)));
        assert_ne!(hash_of(&(3u32, 5u16, 9u16)), hash_of(&(3u32, 9u16, 5u16)));
        let held: Vec<u16> = (0..37).collect();
        let mut other = held.clone();
        other[36] = 1;
        assert_ne!(hash_of(&held[..]), hash_of(&other[..]));
        // a short tail counts its length: [0] and [0, 0] differ
        assert_ne!(hash_of(&[0u8][..]), hash_of(&[0u8, 0][..]));
    }

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
