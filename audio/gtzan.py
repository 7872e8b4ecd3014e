"""GTZAN: the ten genres, in the fixed order every model and report uses."""

GENRES = ("blues", "classical", "country", "disco", "hiphop", "jazz", "metal", "pop", "reggae",
          "rock")
